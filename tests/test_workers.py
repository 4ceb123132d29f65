"""``kvspec fuzz --workers N`` (issue 28, item 4): N processes, one example
database, seeds SEED..SEED+N-1, a summed summary and the worst verdict; the
throughput figure is bench/bench_workers.py's, not a test's."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from cli_run import run_kvspec


def fuzz(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_kvspec(cwd, "fuzz", "--json", *args)


def test_a_violation_in_a_worker_fails_the_campaign(tmp_path):
    done = fuzz(tmp_path, "--target", "mutant:abort_marks_stopped", "--workers", "2",
                "--budget", "8s", "--junit", str(tmp_path / "j.xml"))
    assert done.returncode == 1, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["workers"] == 2 and summary["seeds"] == [0, 1]
    assert summary["verdict"] == "violated" and summary["violations"]
    assert summary["traces"] and all(Path(tmp_path, t).is_file() for t in summary["traces"])
    assert "worker 0 (seed 0): exit 1" in done.stderr and "counterexample" in done.stderr
    assert "kvspec replay" in done.stderr
    assert "<failure" in (tmp_path / "j.xml").read_text()
    # one database for both workers
    assert [p.name for p in (tmp_path / ".kvspec").iterdir() if p.is_dir()] \
        .count("examples") == 1


def test_an_examples_budget_is_split_and_sums_the_same_every_time(tmp_path):
    first = fuzz(tmp_path / "a", "--workers", "2", "--examples", "20", "--seed", "5")
    second = fuzz(tmp_path / "b", "--workers", "2", "--examples", "20", "--seed", "5")
    assert first.returncode == second.returncode == 0, first.stderr[-2000:]
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["seeds"] == [5, 6]
    assert (a["runs"], a["actions"]) == (b["runs"], b["actions"])
    assert [c["witnessed"] for c in a["claims"]] == [c["witnessed"] for c in b["claims"]]


def test_a_bad_worker_count_is_one_line(tmp_path):
    done = fuzz(tmp_path, "--workers", "0")
    assert done.returncode == 2
    assert done.stderr.strip() == "kvspec: error: --workers 0: between 1 and 64"


def test_a_campaign_prints_its_summed_summary(tmp_path):
    """Without --json the campaign prints, as one run does, its verdict line,
    the claims summed over the workers and those no worker witnessed."""
    done = run_kvspec(tmp_path, "fuzz", "--workers", "2", "--examples", "6", "--seed", "5")
    assert done.returncode == 0, done.stderr[-2000:]
    as_json = json.loads(run_kvspec(tmp_path / "j", "fuzz", "--json", "--workers", "2",
                                    "--examples", "6", "--seed", "5").stdout)
    assert as_json["verdict_line"].split()[0] in done.stdout
    checked = {c["name"]: c["checked"] for c in as_json["claims"] if c["checked"]}
    name, count = max(checked.items(), key=lambda kv: kv[1])
    row = next(line for line in done.stdout.splitlines() if f" {name} " in line)
    assert str(count) in row.split()  # the sum of both workers' checks
    for claim, why in as_json["unwitnessed"].items():
        assert f"never witnessed by any worker: {claim} ({why})" in " ".join(done.stdout.split())


def test_a_campaign_s_unwitnessed_claims_keep_their_reasons():
    """A campaign's JSON lists what no worker witnessed as one run's does
    (name -> why), not as bare names."""
    from kvspec.parallel import SPLIT_REASON, combine
    one = dict(_summary("HOLDS", []), unwitnessed={"a": "needs x", "b": "needs y", "c": "z"})
    two = dict(_summary("HOLDS", []), unwitnessed={"a": "needs x", "b": "other", "d": "w"})
    assert combine([one, two])["unwitnessed"] == {"a": "needs x", "b": SPLIT_REASON}


def _summary(line: str, known: list[dict], violations=()) -> dict:
    return {"claims": [], "elapsed_s": 1.0, "actions": 1, "runs": 1,
            "violations": list(violations), "verdict": "hold", "verdict_line": line,
            "trace": None, "exit_code": 0, "seed": 0, "unwitnessed": {}, "state_checks": {},
            "known_findings": known}


def _hit(count: int, finding="hybrid-sync-load-failure-unreportable") -> dict:
    return {"finding": finding, "label": finding, "count": count, "how": "",
            "upstream": None, "claims": ["no_garbage_computed"], "trace": None}


def test_known_findings_are_counted_over_every_worker():
    """A campaign's verdict line and JSON count a known finding over all
    workers, not worker 0's alone (session 20's 38-minute campaign printed
    2149x for 4,296 meetings)."""
    from kvspec.parallel import combine
    name = "hybrid-sync-load-failure-unreportable"
    lost = " | LOST PERFORMANCE (no safety claim broken by it): k (1x, trace t)"
    summary = combine([
        _summary(f"HOLDS | narrowed as asked: x | known findings met: {name} (2149x)" + lost,
                 [_hit(2149)]),
        _summary(f"HOLDS | known findings met: {name} (2147x), other (1x)",
                 [_hit(2147), _hit(1, "other")]),
    ])
    assert [(k["finding"], k["count"]) for k in summary["known_findings"]] == [
        (name, 4296), ("other", 1)]
    assert summary["verdict_line"] == (
        f"HOLDS | narrowed as asked: x | known findings met: {name} (4296x), other (1x)" + lost)


def test_a_worker_that_met_no_known_finding_gains_the_others_note():
    from kvspec.parallel import combine
    failing = _summary("VIOLATED, new: c", [], violations=[{"claim": "c", "message": "m"}])
    summary = combine([_summary("HOLDS | known findings met: f (3x)", [_hit(3, "f")]), failing])
    assert summary["verdict_line"] == "VIOLATED, new: c | known findings met: f (3x)"
    assert combine([_summary("HOLDS", [])] * 2)["verdict_line"] == "HOLDS"
    plain = _summary("HOLD: every claim held", [])
    met = _summary("HOLD: no new violation (known findings aside) | known findings met: f (2x)",
                   [_hit(2, "f")])
    assert combine([plain, met])["verdict_line"] == (
        "HOLD: no new violation (known findings aside) | known findings met: f (2x)")
