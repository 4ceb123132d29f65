"""A verdict that fails only sometimes on replay is reported as flaky (issue 28,
item 6): a new counterexample's saved trace is replayed again before it is
reported, and the verdict line and ``--json`` say how many replays broke it."""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

from cli_run import run_kvspec

from kvspec.harness.fuzz import FuzzResult, count_failing_replays
from kvspec.verdict import EXIT_VIOLATED, first_line


def _outcome(claims):
    return SimpleNamespace(violations=[SimpleNamespace(invariant=c) for c in claims])


def test_replays_that_break_it_only_sometimes_are_counted():
    answers = itertools.cycle([["abort_relation"], [], ["other_claim"]])
    fake = lambda path, target: _outcome(next(answers))  # noqa: E731
    assert count_failing_replays(Path("t.json"), "impl", {"abort_relation"}, 3, fake) == (1, 3)


def test_a_replay_that_cannot_run_counts_as_not_failing():
    def broken(path, target):
        raise RuntimeError("the target went away")
    assert count_failing_replays(Path("t.json"), "impl", {"x"}, 2, broken) == (0, 2)


def test_the_verdict_line_says_flaky_and_still_fails():
    violation = SimpleNamespace(invariant="abort_relation")
    result = FuzzResult("impl", 0, 1.0, 1, 1, {},
                        counterexample=SimpleNamespace(violations=[violation]),
                        replays=(1, 3))
    line, code = first_line(result, [])
    assert line.startswith("VIOLATED (FLAKY: the saved trace broke it in 1 of 3 replays), new: "
                           "abort_relation")
    assert code == EXIT_VIOLATED
    result.replays = (3, 3)
    assert first_line(result, [])[0].startswith("VIOLATED, new: abort_relation")


def test_a_deterministic_violation_is_replayed_and_not_flaky(tmp_path):
    done = run_kvspec(tmp_path, "check", "--target", "mutant:abort_marks_stopped",
                      "--budget", "6s", "--json", timeout=300)
    assert done.returncode == 1, done.stderr[-1500:]
    summary = json.loads(done.stdout)
    assert summary["replays"] == {"failed": 3, "of": 3, "flaky": False}
    assert "FLAKY" not in summary["verdict_line"]
