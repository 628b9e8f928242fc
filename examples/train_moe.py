"""Train a small byte-level MoE transformer: the entry script of the `moe_lm` package next to it.

    PYTHONPATH=. python examples/train_moe.py --help

What a run does and writes, and the package's modules, are described in `moe_lm/__init__.py`.
"""

import sys
from pathlib import Path

# `python examples/train_moe.py` already puts this directory first on sys.path; keep `moe_lm`
# importable when the script is started some other way (e.g. `python -P`, runpy).
_EXAMPLES = str(Path(__file__).resolve().parent)
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

from moe_lm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
