"""A budget in runs (issue 28, item 6): ``--examples N`` explores the same way on
any machine, whatever its speed or load, and whatever earlier runs left in the
example database: the same runs, actions and witnessed counts, and the same trace
for a failure."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
