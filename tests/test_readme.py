"""The README's "Use it in your model" code, run as written in a fresh interpreter on 8 host
CPU devices (the setting its text gives for a CPU-only machine)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# A fresh interpreter: the slow lane, run on one pin only.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _python_block(section: str) -> str:
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


def test_use_it_in_your_model_runs_as_written(tmp_path):
    script = tmp_path / "use_it.py"
    script.write_text(_python_block("Use it in your model"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(8, 16, 64) (128, 2) dropped" in proc.stdout, proc.stdout
