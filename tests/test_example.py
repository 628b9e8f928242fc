"""The training example `examples/train_moe.py`: artifacts, learning, resume, CLI, EP and multi-process.

Most runs call the example package's `cli.main()` (`examples/moe_lm`) in this process with a tiny
model; runs that need their own device count (EP on 2 devices, two processes joined by
`jax.distributed`) are subprocesses of the entry script `examples/train_moe.py`, run as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from examples.moe_lm import cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_moe.py"

TINY = [
    "--batch", "4", "--seq", "16", "--d-model", "32", "--layers", "1", "--heads", "2",
    "--experts", "4", "--top-k", "2", "--d-ff", "32", "--log-every", "1", "--eval-batches", "1",
]


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _ce(metrics: dict) -> np.ndarray:
    return np.array([r["ce"] for r in metrics["history"]])


def _subprocess_env(host_devices: int | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    # The root conftest forces 8 host devices for this process; children choose their own.
    # (--xla_backend_optimization_level=0 roughly halves XLA:CPU compile time for these tiny runs.)
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0" + (
        f" --xla_force_host_platform_device_count={host_devices}" if host_devices else ""
    )
    return env


@pytest.mark.slow  # 40 steps, checkpoints and the plot; short runs below train on every pin
def test_overfit_loss_falls_and_artifacts_written(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "run"
    steps = 40
    cli.main(
        TINY + ["--data", str(corpus), "--steps", str(steps), "--lr", "1e-2", "--warmup", "5",
                "--batch", "8", "--eval-every", "20", "--ckpt-every", "20", "--out", str(out)]
    )

    metrics = _metrics(out)
    ce = _ce(metrics)
    assert [r["step"] for r in metrics["history"]] == list(range(1, steps + 1))
    assert np.all(np.isfinite(ce)) and np.all(np.isfinite([r["loss"] for r in metrics["history"]]))
    assert ce[0] > 5.0  # about log(256) at initialisation
    assert ce[-5:].mean() < 2.0, ce  # a repeated 45-byte sentence is quickly memorised
    assert [v["step"] for v in metrics["val"]] == [20, 40]
    assert metrics["val"][-1]["loss"] < metrics["val"][0]["loss"]
    for record in metrics["history"]:
        (layer,) = record["layers"]
        assert len(layer["load"]) == 4 and abs(sum(layer["load"]) - 1.0) < 1e-4
        assert 0.0 <= layer["padding_fraction"] < 1.0 and layer["dropped"] == 0

    assert (out / "train_moe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "config.json").read_text())["args"]["steps"] == steps
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["20", "40"]

    # The run's routing traces: every logged step's counts, and the decode loop's newest tokens.
    from benchmarks.traces import decode_traces, train_traces

    train = train_traces(out)
    assert len(train) == steps and all(c.sum() == 8 * 16 * 2 for c in train.values())
    decode = decode_traces(out, tokens=(1, 3))
    assert sorted(decode) == ["decode/T1/layer0", "decode/T3/layer0"]
    assert decode["decode/T3/layer0"].sum() == 3 * 2 and decode["decode/T3/layer0"].shape == (4,)


@pytest.mark.slow  # four runs of the example
def test_resume_continues_the_same_trajectory(tmp_path):
    """Simulate preemption after the step-3 checkpoint: the resumed steps 4..6 repeat the original ones.

    loss_free balancing moves the selection biases every step, so an exact repeat needs the
    parameters, the optimizer state, the step and the biases all restored.
    """
    out = tmp_path / "run"
    args = TINY + ["--balance", "loss_free", "--bias-rate", "0.05", "--warmup", "2", "--ckpt-every", "3",
                   "--steps", "6", "--out", str(out)]
    cli.main(args)
    original = _metrics(out)
    shutil.rmtree(out / "checkpoints" / "6")  # the run "died" before its final checkpoint

    with pytest.raises(SystemExit, match="pass --resume"):
        cli.main(args)
    with pytest.raises(SystemExit, match="--d-model: saved 32, now 64"):
        cli.main(args + ["--resume", "--d-model", "64"])
    with pytest.raises(SystemExit, match=r"--seq: saved 16, now 8 \(it sizes the learned position table\)"):
        cli.main(args + ["--resume", "--seq", "8"])

    cli.main(args + ["--resume"])
    resumed = _metrics(out)
    assert resumed["start_step"] == 3
    assert [r["step"] for r in resumed["history"]] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(_ce(resumed), _ce(original), rtol=1e-5)
    assert not np.allclose(_ce(resumed)[3:], _ce(resumed)[2])  # training really went on


# Together with the default softmax_topk + aux (the overfit test) and loss_free (the resume test),
# these cover every --router and --balance choice, and the model options on the way.
@pytest.mark.parametrize(
    "extra",
    [
        ["--router", "selected_softmax", "--balance", "seq_aux", "--shared-experts", "1", "--no-tied-head"],
        ["--router", "sigmoid_grouped", "--n-group", "2", "--topk-group", "1", "--balance", "none",
         "--latent-dim", "16", "--dtype", "bfloat16", "--backend", "xla"],
        ["--fp8", "--dtype", "bfloat16", "--shared-experts", "1"],
    ],
    ids=["selected_softmax-seq_aux-shared-untied", "sigmoid_grouped-none-latent-bf16", "fp8-bf16-shared"],
)
@pytest.mark.slow  # whole training runs; the one-step run below trains on every pin
def test_router_and_balance_choices_train(tmp_path, extra):
    out = tmp_path / "run"
    cli.main(TINY + extra + ["--steps", "2", "--out", str(out)])
    history = _metrics(out)["history"]
    assert len(history) == 2
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["layers"][0]["aux"]) for r in history)
    if "none" in extra:  # no balancing term: the objective is cross-entropy plus the z-loss only
        record = history[-1]
        np.testing.assert_allclose(record["loss"], record["ce"] + 1e-3 * record["layers"][0]["z"], rtol=1e-5)


@pytest.mark.slow  # a whole EP run that recompiles after each rebalance, in a subprocess
def test_rebalance_every_moves_experts_between_steps(tmp_path):
    """`--ep 2 --rebalance-every 2` on 2 host devices (a child process: on a one-GPU host this
    process sees one device): the placements are re-planned after steps 2 and 4, training goes on
    (finite losses), and each record's per-rank rows follow the placement the step ran (they add up
    to the layer's routes)."""
    out = tmp_path / "run"
    (output,) = _finish(_run_example(TINY + ["--batch", "8", "--ep", "2", "--rebalance-every", "2", "--steps", "5",
                                             "--warmup", "1", "--eval-every", "5", "--no-plot", "--out", str(out)],
                                     host_devices=2, log=tmp_path / "rebalance.log"))
    assert output.count("rebalance: rank max/mean over the last 2 steps") == 2  # after steps 2 and 4
    history = _metrics(out)["history"]
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5]
    for record in history:
        assert np.isfinite(record["loss"])
        layer = record["layers"][0]
        assert len(layer["rank_rows"]) == 2 and abs(sum(layer["rank_rows"]) - sum(layer["counts"])) <= 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--router", "top1"], "invalid choice"),
        (["--balance", "magic"], "invalid choice"),
        (["--steps", "0"], "must be >= 1"),
        (["--lr", "-1"], "must be a finite number >= 0"),
        (["--val-fraction", "1.5"], "strictly between 0 and 1"),
        (["--experts", "4", "--top-k", "5"], "--top-k 5 exceeds --experts 4"),
        (["--d-model", "30", "--heads", "4"], "--heads 4 must divide --d-model 30"),
        (["--n-group", "2"], "only apply to --router sigmoid_grouped"),
        (["--router", "sigmoid_grouped", "--n-group", "3"], "--n-group 3 must divide --experts 8"),
        (["--router", "sigmoid_grouped", "--n-group", "4", "--topk-group", "1", "--top-k", "3"], "exceeds the 2 experts"),
        (["--ep", "3"], "--ep 3 must divide --experts 8"),
        (["--capacity-factor", "1.25"], "--capacity-factor needs --ep"),
        (["--distributed"], "--distributed needs --ep"),
        (["--ep", "2", "--process-id", "0"], "need --distributed"),
        (["--rebalance-every", "2"], "--rebalance-every needs --ep of 2 or more"),
        (["--ep", "2", "--rebalance-every", "2", "--resume"], "--rebalance-every cannot --resume"),
        (["--redundant-slots", "2"], "--redundant-slots needs --rebalance-every"),
        (["--ep-chunks", "2"], "--ep-chunks needs --ep"),
        (["--data", "/nonexistent/corpus.txt"], "no such file"),
        (["--data", "/tmp"], "is a directory; pass one text file"),
    ],
)
def test_bad_arguments_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--steps", "--router", "--balance", "--ep-strategy", "--capacity-factor", "--resume",
                   "--distributed", "--host-devices", "--latent-dim", "--shared-experts", "--backend",
                   "--rebalance-every", "--redundant-slots", "--ep-chunks", "--fp8"):
        assert option in text


def test_missing_matplotlib_stops_the_run_before_training(tmp_path, monkeypatch):
    """The figure needs matplotlib (the examples extra): without it the run stops before the first
    step with the fix (it used to fail after training); --no-plot trains without it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"needs matplotlib.*pip install -e '.\[examples\]'.*--no-plot"):
        cli.main(TINY + ["--steps", "1", "--out", str(out)])
    assert not (out / "metrics.json").exists() and not (out / "checkpoints").exists()
    cli.main(TINY + ["--steps", "1", "--out", str(out), "--no-plot"])
    assert len(_metrics(out)["history"]) == 1 and not (out / "train_moe.png").exists()


def test_small_corpus_is_rejected_with_the_fix(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("too short")
    with pytest.raises(ValueError, match="smaller --seq"):
        cli.main(TINY + ["--data", str(corpus), "--steps", "1", "--out", str(tmp_path / "run")])


# ----------------------------------------------------------------------------- EP and multi-process

EP_ARGS = TINY + ["--steps", "3", "--warmup", "1", "--eval-every", "3"]


@pytest.fixture(scope="module")
def single_device_ce(tmp_path_factory):
    """Cross-entropy per step of EP_ARGS on one device (no mesh), the reference for EP runs."""
    out = tmp_path_factory.mktemp("single")
    cli.main(EP_ARGS + ["--out", str(out)])
    return _ce(_metrics(out))


def _run_example(argv, *, host_devices, log: Path) -> tuple[subprocess.Popen, Path]:
    # Output goes to a file, not a pipe: a pipe nobody reads could block one process of a pair.
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *argv], cwd=ROOT, env=_subprocess_env(host_devices),
            stdout=sink, stderr=subprocess.STDOUT,
        )
    return proc, log


def _finish(*runs: tuple[subprocess.Popen, Path], timeout=240) -> list[str]:
    """Wait for the example processes and return their output; on a timeout kill them all (a lone
    survivor of a distributed pair would otherwise wait for its peer for minutes)."""
    try:
        for proc, _ in runs:
            proc.wait(timeout=timeout)
    finally:
        for proc, _ in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = [log.read_text() for _, log in runs]
    for (proc, _), output in zip(runs, outputs):
        assert proc.returncode == 0, output
    return outputs


@pytest.mark.slow  # a subprocess
def test_ep2_on_two_host_devices_matches_single_device(tmp_path, single_device_ce):
    out = tmp_path / "ep"
    (output,) = _finish(
        _run_example(EP_ARGS + ["--ep", "2", "--out", str(out)], host_devices=2, log=tmp_path / "ep.log")
    )
    assert "mesh {'data': 1, 'ep': 2}" in output
    assert "rank rows max/mean" in output
    metrics = _metrics(out)
    np.testing.assert_allclose(_ce(metrics), single_device_ce, rtol=1e-4)
    # Per-rank rows: the two ranks' expert halves, summing to all real routes of the step.
    for record in metrics["history"]:
        for layer in record["layers"]:
            half = len(layer["load"]) // 2
            load = np.asarray(layer["load"])
            rows = np.asarray(layer["rank_rows"])
            assert rows.sum() == 4 * 16 * 2  # every route of the batch: --batch 4, --seq 16, --top-k 2
            np.testing.assert_allclose(rows / rows.sum(), [load[:half].sum(), load[half:].sum()], atol=1e-5)
            assert layer["rank_imbalance"] == pytest.approx(rows.max() / rows.mean())


@pytest.mark.slow  # two subprocesses
def test_two_processes_with_jax_distributed_match_single_device(tmp_path, single_device_ce):
    with socket.socket() as sock:  # a free port for the coordinator
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "dist"
    # The scale-out options across the two processes too: the exchange in 2 token chunks, and a
    # rebalance after step 2 (replicas of the hot experts, weights and AdamW moments moved by
    # collectives between the processes); neither changes what is computed.
    common = EP_ARGS + ["--ep", "2", "--out", str(out), "--host-devices", "1", "--distributed",
                        "--coordinator", f"localhost:{port}", "--num-processes", "2",
                        "--ep-chunks", "2", "--rebalance-every", "2"]
    outputs = _finish(
        *(_run_example(common + ["--process-id", str(i)], host_devices=None, log=tmp_path / f"p{i}.log") for i in range(2))
    )
    assert "devices: 2 x cpu | mesh {'data': 1, 'ep': 2}" in outputs[0]
    assert outputs[0].count("rebalance: rank max/mean over the last 2 steps") == 1
    assert "done:" not in outputs[1]  # only process 0 reports and writes metrics
    np.testing.assert_allclose(_ce(_metrics(out)), single_device_ce, rtol=1e-4)
    assert (out / "checkpoints" / "3").is_dir()
