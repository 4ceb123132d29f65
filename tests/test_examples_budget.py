"""A budget in runs (issue 28, item 6): ``--examples N`` explores the same way on
any machine, whatever its speed or load, and whatever earlier runs left in the
example database: the same runs, actions and witnessed counts, and the same trace
for a failure."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_kvspec


def run_check(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_kvspec(cwd, "check", "--json", *args)


def get_exploration(done: subprocess.CompletedProcess) -> dict:
    summary = json.loads(done.stdout)
    return {"runs": summary["runs"], "actions": summary["actions"],
            "witnessed": {c["name"]: c["witnessed"] for c in summary["claims"]},
            "features": summary["features"], "examples": summary["examples_budget"]}


def test_the_same_seed_explores_the_same_way_under_load(tmp_path):
    quiet = run_check(tmp_path / "a", "--examples", "40", "--seed", "3")
    # another "machine": two busy loops beside it, so its wall clock runs differently
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = run_check(tmp_path / "b", "--examples", "40", "--seed", "3")
    finally:
        for hog in hogs:
            hog.kill()
    assert quiet.returncode == loaded.returncode == 0, quiet.stderr[-1500:]
    assert get_exploration(quiet) == get_exploration(loaded)
    assert get_exploration(quiet)["examples"] == 40
    assert "budget 40 runs" in quiet.stderr


def test_a_failure_is_found_and_shrunk_to_the_same_trace(tmp_path):
    args = ("--target", "mutant:abort_marks_stopped", "--examples", "30")
    first = run_check(tmp_path, *args, "--out", str(tmp_path / "first"))
    # the same directory: the database now holds the failure, which an examples
    # budget does not replay first, so the exploration is unchanged
    second = run_check(tmp_path, *args, "--out", str(tmp_path / "second"))
    assert first.returncode == second.returncode == 1, first.stderr[-1500:]
    [a], [b] = list((tmp_path / "first").glob("*.json")), list((tmp_path / "second").glob("*.json"))
    assert a.read_bytes() == b.read_bytes()
    assert get_exploration(first) == get_exploration(second)


def test_a_budget_of_no_runs_is_one_line(tmp_path):
    done = run_check(tmp_path, "--examples", "0")
    assert done.returncode == 2
    assert done.stderr.strip() == "kvspec: error: --examples 0: a number of runs, at least 1"


# -- --time-limit: the wall-clock safety net of a budget in runs ------------------------------

def test_the_time_limit_stops_a_budget_in_runs_as_incomplete(tmp_path):
    """A CI job's timeout would kill a budget in runs too large for its runner
    before any report is written; ``--time-limit`` stops it first, judged up to
    there, and says how many of the runs were made (exit 3, never a PASS)."""
    done = run_check(tmp_path, "--examples", "1000000", "--time-limit", "3s")
    assert done.returncode == 3, done.stderr[-1500:]
    summary = json.loads(done.stdout)
    assert summary["time_limited"] is True and summary["time_limit_s"] == 3.0
    assert summary["budget_s"] is None  # no time budget applied (it said 60, the default)
    assert 0 < summary["runs"] < 1000000
    assert summary["verdict_line"].startswith(
        "INCOMPLETE: no violation in the runs made, but not every run asked for was made | "
        f"--time-limit 3s stopped the run after {summary['runs']} of 1000000 runs (--examples)")


def test_a_violation_found_before_the_time_limit_is_kept(tmp_path):
    """Found (and saved) before the limit: a violation, its trace replayable,
    though the limit cut its shrinking."""
    done = run_check(tmp_path, "--target", "mutant:cache_failed_block", "--examples",
                     "1000000", "--time-limit", "3s", "--out", str(tmp_path / "out"))
    assert done.returncode == 1, done.stderr[-1500:]
    summary = json.loads(done.stdout)
    assert summary["verdict_line"].startswith("VIOLATED, new: no_caching_of_invalid_blocks | "
                                              "--time-limit 3s stopped the run after")
    [trace] = list((tmp_path / "out").glob("*.json"))
    replayed = run_kvspec(tmp_path, "replay", str(trace))
    assert replayed.returncode == 1 and "still fails" in replayed.stdout, replayed.stdout[-800:]


def test_a_budget_in_runs_done_sooner_is_not_touched_by_its_time_limit(tmp_path):
    plain = run_check(tmp_path / "a", "--examples", "20", "--seed", "3")
    limited = run_check(tmp_path / "b", "--examples", "20", "--seed", "3", "--time-limit", "1h")
    assert plain.returncode == limited.returncode == 0, limited.stderr[-1500:]
    assert get_exploration(plain) == get_exploration(limited)
    assert json.loads(limited.stdout)["time_limited"] is False


@pytest.mark.parametrize("args, says", [
    (("--time-limit", "10m"), "--time-limit applies with --examples (a budget in runs); "
                              "--budget is a time limit already"),
    (("--examples", "5", "--time-limit", "3x"),
     "invalid --time-limit '3x': use a positive duration like 60s, 10m or 1h"),
])
def test_a_bad_time_limit_is_one_line(tmp_path, args, says):
    done = run_check(tmp_path, *args)
    assert done.returncode == 2
    assert done.stderr.strip() == f"kvspec: error: {says}"
