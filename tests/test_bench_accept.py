"""The acceptance run's verdict (`benchmarks.accept.verdict`) read from a run's logs: green only when
every criterion of docs/acceptance.md holds, and each way of failing one turns it red."""

import json
import subprocess
import sys

import pytest

from benchmarks import accept


def _write_green(tmp_path):
    (tmp_path / "tests.log").write_text(  # `--durations` lists the slowest tests, names with "failed" among them
        "....\n============ slowest 40 durations ============\n"
        "41.20s call     tests/test_bench_accept.py::test_failed_tests_count_only_when_all_pass_rerun_alone[2 failed]\n"
        "943 passed, 3 skipped, 2 warnings in 319.83s (0:05:19)\n")
    for run in accept.EXAMPLE_RUNS:
        (tmp_path / f"example_{run}.log").write_text("done: steps 0..300 in 39.3 s | loss 5.645 -> 2.273 | val 2.3\nexit 0\n")
    rows = []
    for shape in accept.LAYER_SHAPES:
        for dtype in ("float32", "bfloat16"):
            for backend in accept.LAYER_BACKENDS:
                cell = "ok"
                if backend == "mosaic_gpu" and dtype == "float32":
                    cell = "ValueError: mosaic_gpu multiplies bf16/fp16 only (wgmma), not float32"
                if backend == "xla" and shape == accept.LAYER_SHAPES[-1]:
                    cell = "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 48.00GiB"
                if backend == "xla" and shape == accept.LAYER_SHAPES[-2] and dtype == "float32":  # its autotuner's
                    cell = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Failed to get configs for: 5 out of 36 "
                            "instructions. See logs for all failures. Example failure: ")
                rows.append(dict(shape=list(shape), dtype=dtype, backend=backend, cell=cell))
    (tmp_path / "accept_layers.json").write_text(json.dumps(rows))
    (tmp_path / "compiled.jsonl").write_text(json.dumps(dict(compiled=100, model=120)) + "\n")
    (tmp_path / "accept_labels.json").write_text(json.dumps([{"model": 10}]))
    (tmp_path / "accept_resources.json").write_text(json.dumps([{"model": 10, "compiled": 9, "ok": True}]))
    return rows


def _failed(tmp_path):
    return [name for name, ok, _ in accept.verdict(str(tmp_path)) if not ok]


def test_a_complete_passing_run_is_green(tmp_path):
    _write_green(tmp_path)
    assert _failed(tmp_path) == []


@pytest.mark.parametrize("breakage, check", [
    ("tests", "tests and parity compiled"),
    ("example", "example float32"),
    ("loss", "example bfloat16"),
    ("fp8", "example fp8"),
    ("ours-oom", "layer table"),
    ("xla-typeerror", "layer table"),
    ("missing-cell", "layer table"),
    ("cell-twice", "layer table"),
    ("compiled", "model vs Triton's compiler"),
    ("launch", "model vs launched kernels"),
])
def test_each_failure_turns_the_run_red(tmp_path, breakage, check):
    rows = _write_green(tmp_path)
    if breakage == "tests":
        (tmp_path / "tests.log").write_text("1 failed, 942 passed in 300s\n")
    elif breakage == "example":
        (tmp_path / "example_float32.log").write_text("Traceback ...\nexit 1\n")
    elif breakage == "fp8":
        (tmp_path / "example_fp8.log").unlink()
    elif breakage == "loss":
        (tmp_path / "example_bfloat16.log").write_text("done: loss 2.0 -> 5.6 | val 5\nexit 0\n")
    elif breakage == "cell-twice":  # a lane's file repeating a cell of another
        (tmp_path / "b-accept_layers.json").write_text(json.dumps(rows[:1]))
    elif breakage in ("ours-oom", "xla-typeerror", "missing-cell"):
        if breakage == "ours-oom":  # only XLA's own layer may run out of memory
            rows[0]["cell"] = "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"
        elif breakage == "xla-typeerror":
            next(r for r in rows if r["backend"] == "xla")["cell"] = "TypeError: boom"
        else:
            rows.pop()
        (tmp_path / "accept_layers.json").write_text(json.dumps(rows))
    elif breakage == "compiled":
        (tmp_path / "compiled.jsonl").write_text(json.dumps(dict(compiled=121, model=120)) + "\n")
    else:
        (tmp_path / "accept_resources.json").write_text(json.dumps([]))
    assert _failed(tmp_path) == [check]


def test_lanes_layer_cells_are_read_together(tmp_path):
    """Shapes split over processes (`LANE=a`, `LANE=b`) make one table."""
    rows = _write_green(tmp_path)
    (tmp_path / "accept_layers.json").unlink()
    half = len(rows) // 2
    (tmp_path / "a-accept_layers.json").write_text(json.dumps(rows[:half]))
    (tmp_path / "b-accept_layers.json").write_text(json.dumps(rows[half:]))
    assert _failed(tmp_path) == []
    (tmp_path / "b-accept_layers.json").unlink()
    assert _failed(tmp_path) == ["layer table"]


def test_summary_sets_the_fp8_example_beside_bf16(tmp_path, capsys):
    """The summary's FP8 training curve from the two runs' logs: the losses at every 50th and the
    last logged step and each validation loss, FP8's difference to bf16 signed; a run whose log has
    no losses leaves the table out."""
    import argparse

    _write_green(tmp_path)
    (tmp_path / "accept_layers.json").unlink()  # the layer table is not this test's
    for run, offset in (("bfloat16", 0.0), ("fp8", 0.01)):
        lines = [f"step {s:>6} | loss {5.0 - s / 100 + offset:.4f} ce 1.0 | lr 1e-3 | grad 0.5 | 9 tok/s"
                 for s in range(25, 130, 25)]
        lines += [f"step {s:>6} | val loss {4.0 - s / 1000 + offset:.4f}" for s in (100, 125)]
        (tmp_path / f"example_{run}.log").write_text("\n".join(lines + ["done: loss 5.0 -> 3.8", "exit 0"]))
    accept.summary(argparse.Namespace(out=str(tmp_path), commit="abc1234", device="one H200"))
    text = (tmp_path / "accept_summary.md").read_text()
    assert "FP8 against bf16, same seed" in text
    assert "| train | 50 | 4.5000 | 4.5100 | +0.0100 |" in text
    assert "| train | 125 | 3.7500 | 3.7600 | +0.0100 |" in text  # the last logged step
    assert "| val | 100 | 3.9000 | 3.9100 | +0.0100 |" in text
    assert "| train | 75 |" not in text
    (tmp_path / "example_fp8.log").write_text("Traceback ...\nexit 1\n")
    accept.summary(argparse.Namespace(out=str(tmp_path), commit="abc1234", device="one H200"))
    assert "FP8 against bf16" not in (tmp_path / "accept_summary.md").read_text()
    capsys.readouterr()


@pytest.mark.parametrize("rerun, green", [
    ("2 passed in 30s\n", True),
    ("1 failed, 1 passed in 30s\n", False),
    ("1 passed in 30s\n", False),  # one of the two never ran again
    ("", False),
])
def test_failed_tests_count_only_when_all_pass_rerun_alone(tmp_path, rerun, green):
    """A smaller card runs tests out of memory beside the other workers: `accept-rerun` runs exactly
    the ids the log reports failed again, and the tests count as passed only if all of them pass."""
    _write_green(tmp_path)
    log = ("FAILED tests/test_a.py::test_x[bf16] - RESOURCE_EXHAUSTED: out of memory\n"
           "ERROR parity/tests/test_b.py::test_y - torch.OutOfMemoryError\n"
           "1 failed, 941 passed, 1 error in 300s\n")
    (tmp_path / "tests.log").write_text(log)
    assert accept.failed_ids(log) == ["tests/test_a.py::test_x[bf16]", "parity/tests/test_b.py::test_y"]
    assert _failed(tmp_path) == ["tests and parity compiled"]  # no rerun: red
    (tmp_path / "tests_rerun_ids.txt").write_text("\n".join(accept.failed_ids(log)) + "\n")
    (tmp_path / "tests_rerun.log").write_text(rerun)
    assert _failed(tmp_path) == ([] if green else ["tests and parity compiled"])


def test_tests_stopped_at_their_limit_are_never_green_alone(tmp_path):
    """`accept-tests` stops pytest with SIGINT at its limit, and pytest still prints its counts and
    names its failures: counts of the tests that ran, not of the suite, so the run is red even when
    nothing failed (unless `accept-rest` ran the others), and the ids that did fail are there to
    rerun."""
    _write_green(tmp_path)
    log = ("!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!\n"
           "FAILED tests/test_a.py::test_x - AssertionError\n"
           "1 failed, 1172 passed, 3 skipped in 500.12s\n")
    (tmp_path / "tests.log").write_text(log)
    assert accept.interrupted(log) and accept.failed_ids(log) == ["tests/test_a.py::test_x"]
    (tmp_path / "tests_rerun_ids.txt").write_text("tests/test_a.py::test_x\n")
    (tmp_path / "tests_rerun.log").write_text("1 passed in 30s\n")
    assert _failed(tmp_path) == ["tests and parity compiled"]
    (tmp_path / "tests.log").write_text(log.replace("1 failed, ", "").replace("FAILED", "x"))
    assert _failed(tmp_path) == ["tests and parity compiled"]
    (tmp_path / "tests.log").write_text("1173 passed, 3 skipped in 433.0s\n")
    assert _failed(tmp_path) == []


def test_a_later_lane_makes_only_the_cells_it_names(tmp_path):
    """`--dtypes` / `--backends` make exactly the cells an earlier lane did not reach: the reference
    (`xla` here) runs but gives no cell, and the file holds each cell as it is made."""
    import argparse

    path = tmp_path / "c-accept_layers.json"
    accept.layers(argparse.Namespace(shapes="0", dtypes="float32", backends="auto", json=str(path)))
    rows = json.loads(path.read_text())
    assert [(r["dtype"], r["backend"], r["reference"], r["cell"]) for r in rows] == [("float32", "auto", "xla", "ok")]
    with pytest.raises(ValueError, match="--backends.*'cuda'"):
        accept.layers(argparse.Namespace(shapes="0", dtypes=None, backends="auto,cuda", json=None))


def test_launches_stopped_at_the_limit_keep_their_labels_and_stay_red(tmp_path):
    """`run_plan` writes every label before the first launch and marks each once it ran: a run
    killed mid-way pairs what Nsight profiled with the labels launched, and the verdict counts the
    labels never reached."""
    import argparse

    def stopped():
        raise TimeoutError("the phase's limit")

    label = dict(family="group_major", tiles=[128, 128], dtype="bfloat16", ieee=False, gather=False)
    plan = [(dict(label, backend="pallas_triton", kernel="gmm", model=100), lambda: None),
            (dict(label, backend="mosaic_gpu", kernel="gmm", model=200), stopped)]
    (tmp_path / "ncu").mkdir()
    labels = tmp_path / "ncu" / "accept_labels.json"
    with pytest.raises(TimeoutError):
        accept.run_plan(plan, str(labels))
    assert [label["launched"] for label in json.loads(labels.read_text())] == [True, False]
    csv = tmp_path / "ncu" / "accept_ncu.csv"
    csv.write_text('"ID","Kernel Name","Metric Name","Metric Value"\n'
                   '"0","moe_jax_gmm_group_major","launch__shared_mem_per_block_dynamic","96"\n')
    resources = tmp_path / "ncu" / "accept_resources.json"
    accept.ncu_table(argparse.Namespace(csv=str(csv), labels=str(labels), out=str(resources)))
    assert [(r["kernel"], r["compiled"], r["ok"]) for r in json.loads(resources.read_text())] == [("gmm", 96, True)]
    _write_green(tmp_path)
    (tmp_path / "accept_labels.json").write_text(labels.read_text())
    (tmp_path / "accept_resources.json").write_text(resources.read_text())
    assert _failed(tmp_path) == ["model vs launched kernels"]


STOPPED = "!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!\n1172 passed, 3 skipped in 548.12s\n"


TWO = "tests/test_a.py::test_x\nparity/tests/test_b.py::test_y[two words]\n"


@pytest.mark.parametrize("ids, rest, green", [
    (TWO, "2 passed in 90s\n", True),
    (TWO, "1 passed, 1 skipped in 90s\n", True),
    (TWO, "1 failed, 1 passed in 90s\n", False),
    (TWO, "1 passed in 90s\n", False),  # one was never run
    (TWO, "!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!\n2 passed in 90s\n", False),
    (TWO, "", False),
    ("", "every test was reached\n", True),  # stopped after its last test, before its summary
])
def test_tests_stopped_at_their_limit_are_green_when_the_rest_pass(tmp_path, ids, rest, green):
    """A slower host's `accept-tests` stops at its limit; `accept-rest` (in a later call) runs exactly
    the tests its JUnit report does not hold, and the suite counts as run only when every one of
    them passed or skipped."""
    _write_green(tmp_path)
    (tmp_path / "tests.log").write_text(STOPPED)
    (tmp_path / "tests_rest_ids.txt").write_text(ids)
    (tmp_path / "tests_rest.log").write_text(rest)
    assert _failed(tmp_path) == ([] if green else ["tests and parity compiled"])


def test_a_failure_before_the_limit_still_needs_its_rerun_beside_the_rest(tmp_path):
    _write_green(tmp_path)
    (tmp_path / "tests.log").write_text("FAILED tests/test_a.py::test_x - AssertionError\n"
                                        + STOPPED.replace("1172 passed", "1 failed, 1171 passed"))
    (tmp_path / "tests_rest_ids.txt").write_text("tests/test_c.py::test_z\n")
    (tmp_path / "tests_rest.log").write_text("1 passed in 9s\n")
    assert _failed(tmp_path) == ["tests and parity compiled"]
    (tmp_path / "tests_rerun_ids.txt").write_text("tests/test_a.py::test_x\n")
    (tmp_path / "tests_rerun.log").write_text("1 passed in 30s\n")
    assert _failed(tmp_path) == []


def test_unreached_ids_are_the_collected_tests_a_stopped_run_never_reported(tmp_path, monkeypatch):
    """pytest writes its JUnit report when interrupted too: the ids `accept-rest` runs are what
    pytest collects less what that report holds, ids with spaces and test classes included."""
    (tmp_path / "test_mod.py").write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "def test_b(): raise KeyboardInterrupt  # as SIGINT at the limit\n"
        "class TestC:\n"
        "    def test_c(self): pass\n"
        "@pytest.mark.parametrize('v', ['two words', 'x'])\n"
        "def test_d(v): pass\n")
    monkeypatch.chdir(tmp_path)
    stopped = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", "r.xml",
                              "test_mod.py"], capture_output=True, text=True)
    assert accept.interrupted(stopped.stdout + stopped.stderr)
    collected = accept.collect_ids(["test_mod.py"])
    assert collected == ["test_mod.py::test_a", "test_mod.py::test_b", "test_mod.py::TestC::test_c",
                         "test_mod.py::test_d[two words]", "test_mod.py::test_d[x]"]
    assert accept.unreached_ids(collected, (tmp_path / "r.xml").read_text()) == collected[1:]
    finished = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", "all.xml",
                               *collected[2:]], capture_output=True, text=True)
    assert finished.returncode == 0, finished.stdout
    assert accept.unreached_ids(collected, (tmp_path / "all.xml").read_text()) == collected[:2]
