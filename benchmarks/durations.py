"""Test durations from pytest's JUnit XML reports, and the slowest-first order the GPU acceptance
run's pytest takes from them.

pytest-xdist's `load` scheduler hands tests to its workers in collection order, so a long test
collected late starts late and the run ends when it does: the compiled suite on an 80 GB H100 took
472 s at 16 workers for 5796 worker-seconds of tests (362 s if they had shared the work evenly),
its slowest single test 135-144 s (`benchmarks/results/2026-12-06-h100-accept-16-partial.md`).
Handing out the longest first (Graham's LPT rule: R. L. Graham, "Bounds on Multiprocessing Timing
Anomalies", SIAM J. Appl. Math. 17(2), 1969) ends within 4/3 of the best schedule.

`seconds.json` (`benchmarks/data/gpu_test_seconds.json`) maps each test, as the report names it
(`classname::name`), to its seconds; `conftest.py` orders the collected tests by it when
`TEST_SECONDS` names such a file (the acceptance phases do). Tests it does not hold (new ones) go
first: their duration is unknown, and a long one started last would cost most. Stdlib only: the
repository's conftest imports it before anything starts JAX.

    python -m benchmarks.durations from-junit tests.xml > benchmarks/data/gpu_test_seconds.json
"""

from __future__ import annotations

import argparse
import json
import re
from xml.etree import ElementTree

__all__ = ["junit_key", "junit_seconds", "reached_keys", "slowest_first"]


def junit_key(nodeid: str) -> tuple[str, str]:
    """A pytest node id as its JUnit XML report names it: `(classname, name)`, the classname the
    module's path dotted and without `.py`, followed by any test classes."""
    path, *classes, name = nodeid.split("::")
    return ".".join([re.sub(r"\.py$", "", path).replace("/", "."), *classes]), name


def reached_keys(junit_xml: str) -> set[tuple[str, str]]:
    """`(classname, name)` of every test a JUnit XML report holds: those a pytest stopped at its
    limit had reported (pytest writes the report when interrupted too)."""
    return {(c.get("classname"), c.get("name")) for c in ElementTree.fromstring(junit_xml).iter("testcase")}


def junit_seconds(junit_xml: str) -> dict[str, float]:
    """`{"classname::name": seconds}` of every test a JUnit XML report holds (setup, call and
    teardown together, as pytest reports a test's time), rounded to 0.1 s."""
    return {f"{c.get('classname')}::{c.get('name')}": round(float(c.get("time") or 0), 1)
            for c in ElementTree.fromstring(junit_xml).iter("testcase")}


def slowest_first(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """The positions of `nodeids` in the order to run them: those `seconds` does not hold first, in
    their order, then the rest by decreasing seconds (ties in their order)."""
    known = {i: seconds.get("::".join(junit_key(n))) for i, n in enumerate(nodeids)}
    return sorted(range(len(nodeids)), key=lambda i: (known[i] is not None, -(known[i] or 0.0)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.durations", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("from-junit", help="print the seconds of every test a JUnit XML report holds, as JSON")
    q.add_argument("junit_xml")
    args = parser.parse_args(argv)
    with open(args.junit_xml) as f:
        seconds = junit_seconds(f.read())
    print(json.dumps(dict(sorted(seconds.items())), indent=0))


if __name__ == "__main__":
    main()
