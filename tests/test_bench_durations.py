"""The slowest-first test order of the GPU acceptance run (`benchmarks.durations`, conftest.py's
`TEST_SECONDS`): durations read from a JUnit XML report, unknown tests first, and pytest really
collecting in that order."""

import json
import os
import subprocess
import sys

from benchmarks import durations

_REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_a" name="test_fast" time="0.012" />
<testcase classname="tests.test_a.TestGroup" name="test_slow[x-1]" time="143.72"><failure message="m" /></testcase>
<testcase classname="parity.tests.test_b" name="test_mid" time="12.34" />
</testsuite></testsuites>"""


def test_seconds_are_read_per_test_as_the_report_names_it():
    assert durations.junit_seconds(_REPORT) == {
        "tests.test_a::test_fast": 0.0, "tests.test_a.TestGroup::test_slow[x-1]": 143.7,
        "parity.tests.test_b::test_mid": 12.3}
    assert durations.junit_key("tests/test_a.py::TestGroup::test_slow[x-1]") == ("tests.test_a.TestGroup",
                                                                                 "test_slow[x-1]")


def test_unknown_tests_first_then_slowest_first_ties_in_collection_order():
    seconds = durations.junit_seconds(_REPORT) | {"tests.test_a::test_tie": 12.3}
    ids = ["tests/test_a.py::test_fast", "tests/test_a.py::test_new", "parity/tests/test_b.py::test_mid",
           "tests/test_a.py::TestGroup::test_slow[x-1]", "tests/test_a.py::test_tie", "tests/test_c.py::test_new2"]
    order = [ids[i] for i in durations.slowest_first(ids, seconds)]
    assert order == ["tests/test_a.py::test_new", "tests/test_c.py::test_new2", "tests/test_a.py::TestGroup::test_slow[x-1]",
                     "parity/tests/test_b.py::test_mid", "tests/test_a.py::test_tie", "tests/test_a.py::test_fast"]
    assert durations.slowest_first([], seconds) == []


def _collected(env_seconds) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TEST_SECONDS"}
    if env_seconds is not None:
        env["TEST_SECONDS"] = env_seconds
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_bench_durations.py"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return [ln for ln in done.stdout.splitlines() if "::" in ln]


def test_pytest_collects_slowest_first_with_test_seconds(tmp_path):
    plain = _collected(None)
    assert len(plain) == 3
    # The file's order of this module's tests reversed, one left unknown: it runs first.
    seconds = {"::".join(durations.junit_key(n)): float(i) for i, n in enumerate(plain[1:])}
    path = tmp_path / "seconds.json"
    path.write_text(json.dumps(seconds))
    assert _collected(str(path)) == [plain[0], *reversed(plain[1:])]
    assert _collected("") == plain  # empty: the collection order
