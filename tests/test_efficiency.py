"""Efficiency claims, their own kind (issue 25, part 6): work a correct
scheduler need not lose. Reported apart from safety: the run goes on, the
trace is kept, the exit code and the safety verdict stay as they are."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from kvspec.cli import app
from kvspec.harness.replay import replay_trace
from kvspec.spec.registry import REGISTRY

PLAIN_HASH = "mutant:hybrid_cache_under_plain_hash"


def test_the_claim_is_of_role_efficiency():
    assert REGISTRY["computed_blocks_are_cached"].role == "efficiency"


def test_hybrid_blocks_cached_under_the_plain_hash_are_lost_performance(tmp_path):
    """The bug the issue measured (local hits of multi-group requests 439 -> 7,
    every claim held) is caught by a check of the hybrid layouts of one block
    size (found within a second here; 260 times in a 60 s run), as lost
    performance: exit 0, the verdict says HOLD for safety and names the claim,
    the trace replays. (With two block sizes it corrupts too: see the mutant.)"""
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["check", "--target", PLAIN_HASH, "--budget", "8s",
                                      "--seed", "0", "--layouts", "sliding,state,sliding+state",
                                      "--json", "--out", str(out)])
    assert result.exit_code == 0, result.stdout
    report = json.loads(result.stdout)
    assert report["verdict"] == "hold" and report["violations"] == []
    assert "LOST PERFORMANCE" in report["verdict_line"]
    (lost,) = report["efficiency"]
    assert lost["claims"] == ["computed_blocks_are_cached"] and lost["count"] >= 1
    replay = replay_trace(lost["trace"])
    assert {v.invariant for v in replay.violations} == {"computed_blocks_are_cached"}
    assert not replay_trace(lost["trace"], "impl").violations
    # `kvspec replay` says what still happens: lost performance, not a failure
    shown = CliRunner().invoke(app, ["replay", lost["trace"]], env={"COLUMNS": "250"})
    assert shown.exit_code == 1
    assert "still loses performance" in shown.stdout and "still fails" not in shown.stdout


def test_the_reference_loses_nothing(tmp_path):
    """The reference caches a block computed again as vLLM does (a copy beside
    the first), so an eviction of one copy loses no content: no efficiency
    claim breaks in a default check."""
    result = CliRunner().invoke(app, ["check", "--budget", "10s", "--seed", "3", "--json",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.stdout
    report = json.loads(result.stdout)
    assert report["efficiency"] == []
    claim = next(c for c in report["claims"] if c["name"] == "computed_blocks_are_cached")
    assert claim["witnessed"] > 0


def test_lost_performance_never_stops_a_run(tmp_path):
    """The runner keeps the first break of an efficiency claim with the trace up
    to it and goes on: a safety bug later in the run is still found, and a
    finding's trace replays to its own verdict."""
    from kvspec.harness.runner import Runner
    from kvspec.harness.trace import load_trace
    out = tmp_path / "out"
    # the hybrid layouts of one block size: with two, a window block cached under
    # the plain hash is served as a full-attention block (a safety bug, not only
    # lost performance)
    CliRunner().invoke(app, ["check", "--target", PLAIN_HASH, "--budget", "4s", "--seed", "1",
                             "--layouts", "sliding,state,sliding+state",
                             "--json", "--out", str(out)])
    (path,) = (out / "efficiency").glob("*.json")
    data = load_trace(path)
    runner = Runner(PLAIN_HASH, data["config"])
    assert runner.run(data["actions"]) is None
    assert [v.invariant for v in runner.lost[0].violations][:1] == ["computed_blocks_are_cached"]
    assert len(runner.lost[0].runner.actions) == len(data["actions"])
    runner.apply({"op": "drain"})  # the run goes on
    # a replay asked for its lost performance (review asks BASE so) answers with it
    from kvspec.harness.known import replay
    assert replay(PLAIN_HASH, data["config"], data["actions"]).violations == ()
    lost = replay(PLAIN_HASH, data["config"], data["actions"], lost=True)
    assert "computed_blocks_are_cached" in lost.claims and lost.error is None
