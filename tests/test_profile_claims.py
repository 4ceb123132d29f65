"""``check --profile-claims`` (issue 30, item 1): every claim's cost is visible."""
from __future__ import annotations

import json
from pathlib import Path

from cli_run import run_kvspec

from kvspec.harness import checker
from kvspec.harness.runner import Runner
from kvspec.harness.target import make_config


def test_profile_claims_reports_the_costliest_first(tmp_path: Path):
    out = run_kvspec(tmp_path, "check", "--examples", "4", "--profile-claims", "--json")
    assert out.returncode == 0, out.stderr[-800:]
    costs = json.loads(out.stdout)["claim_costs"]
    assert len(costs) > 20
    seconds = [c["seconds"] for c in costs]
    assert seconds == sorted(seconds, reverse=True) and seconds[0] > 0
    assert all(c["evaluations"] > 0 for c in costs)
    assert "claim costs:" in out.stderr and "share of run" in out.stderr


def test_bad_input_with_profile_claims_is_one_line(tmp_path: Path):
    out = run_kvspec(tmp_path, "check", "--profile-claims", "--budget", "xyz")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("kvspec: error: invalid budget") and out.stderr.count("\n") == 1


def test_profiling_times_each_evaluation_and_stops():
    profile = checker.start_profile()
    try:
        runner = Runner("impl", make_config())
        runner.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3], "max_tokens": 2})
        runner.apply({"op": "step"})
    finally:
        found = checker.stop_profile()
    assert found is profile and checker.PROFILE is None
    assert found["computed_within_tokens"][0] == runner.checks["computed_within_tokens"]
    assert all(t >= 0 for _, t in found.values())
