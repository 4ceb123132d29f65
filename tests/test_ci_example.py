"""docs/ci/ (issue 28, items 1, 2 and 5): the example project runs its own tests with
kvspec's pytest plugin through the shell workflow, and the one planted failure (a
mutant standing for a scheduler change with a bug) is reported correctly in every
report CI reads: pytest's exit code, the JUnit file, the Markdown summary, the kept
trace. The GitHub workflow runs the same review script and is valid YAML."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / "docs" / "ci"
PLANTED = "mutant:cache_failed_block"


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("ci")
    project = work / "example"
    shutil.copytree(CI / "example", project)
    reports = work / "reports"
    env = {k: v for k, v in os.environ.items() if k != "KVSPEC_VLLM"}  # the suite's own
    env = dict(env, PYTHON=sys.executable, KVSPEC_TARGETS=f"impl {PLANTED}",
               KVSPEC_BUDGET="10s", KVSPEC_REPORTS=str(reports), GITHUB_STEP_SUMMARY="",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(["bash", str(CI / "kvspec-ci.sh"), str(project)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=work)
    return done, reports


def get_cases(reports: Path) -> dict[str, ET.Element]:
    root = ET.parse(reports / "junit.xml").getroot()
    return {f"{case.get('classname')}::{case.get('name')}": case
            for case in root.iter("testcase")}


def test_the_planted_failure_fails_the_job_and_nothing_else(ci_run):
    done, reports = ci_run
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    cases = get_cases(reports)
    failed = sorted(n for n, c in cases.items() if c.find("failure") is not None)
    assert failed == [f"kvspec::{PLANTED}[all]"], failed
    own = [n for n in cases if n.startswith("tests.test_block_math::")]
    assert len(own) == 6, own  # the example project's own tests ran and passed
    assert "kvspec::impl[all]" in cases


def test_junit_carries_the_counterexample_and_witnessed_counts(ci_run):
    _, reports = ci_run
    case = get_cases(reports)[f"kvspec::{PLANTED}[all]"]
    failure = case.find("failure")
    text = (failure.get("message") or "") + (failure.text or "")
    assert "VIOLATED, new: no_caching_of_invalid_blocks" in text
    assert "kvspec replay" in text and "counterexample" in text  # the step table
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert int(props["witnessed:no_caching_of_invalid_blocks"]) >= 0
    assert props["trace"].endswith(".json")
    held = {p.get("name"): p.get("value")
            for p in get_cases(reports)["kvspec::impl[all]"].iter("property")}
    assert held["verdict"].startswith("HOLD")
    assert int(held["witnessed:cached_le_computed"]) > 0


def test_markdown_says_the_same(ci_run):
    _, reports = ci_run
    text = (reports / "kvspec.md").read_text()
    assert "### kvspec on `impl`: held" in text
    assert f"### kvspec on `{PLANTED}`: VIOLATED" in text
    assert "`no_caching_of_invalid_blocks`:" in text
    assert f"kvspec replay {reports / 'traces'}" in text


def test_the_kept_trace_replays_failing(ci_run):
    _, reports = ci_run
    traces = sorted((reports / "traces").glob("*.json"))
    assert traces, "no trace kept"
    replay = subprocess.run([sys.executable, "-m", "kvspec", "replay", str(traces[0]),
                             "--target", PLANTED], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert replay.returncode == 1, replay.stdout[-2000:] + replay.stderr[-2000:]


def test_the_ci_script_gives_a_budget_in_runs_and_its_time_limit(tmp_path):
    """KVSPEC_EXAMPLES reaches every item in place of the time budget (the plugin
    once passed --budget 60s beside it, and every item failed: 'give one of
    them'), and KVSPEC_TIME_LIMIT stops an item too large for the runner: it
    fails as INCOMPLETE, with how many runs were made."""
    shutil.copytree(CI / "example", tmp_path / "example")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPEC_")}
    env = dict(env, PYTHON=sys.executable, GITHUB_STEP_SUMMARY="",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    def run(reports: str, **settings):
        done = subprocess.run(["bash", str(CI / "kvspec-ci.sh"), str(tmp_path / "example")],
                              env=dict(env, KVSPEC_REPORTS=str(tmp_path / reports), **settings),
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        held = get_cases(tmp_path / reports)["kvspec::impl[all]"]
        return done, {p.get("name"): p.get("value") for p in held.iter("property")}
    done, props = run("by-runs", KVSPEC_EXAMPLES="5")
    assert done.returncode == 0, done.stdout[-3000:]
    assert props["verdict"].startswith("HOLD") and int(props["runs"]) >= 5, props
    done, props = run("cut", KVSPEC_EXAMPLES="1000000", KVSPEC_TIME_LIMIT="3s")
    assert done.returncode == 1, done.stdout[-3000:]
    assert props["verdict"].startswith("INCOMPLETE: no violation in the runs made"), props
    assert "--time-limit 3s stopped the run after" in props["verdict"], props


def test_the_plugin_is_inert_without_the_option(tmp_path):
    shutil.copytree(CI / "example", tmp_path / "example")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=tmp_path / "example", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "6 passed" in done.stdout and "kvspec" not in done.stdout


def test_the_github_workflow_runs_the_review_script():
    yaml = pytest.importorskip("yaml", reason="PyYAML (installed with vLLM) reads the workflow")
    flow = yaml.safe_load((CI / "github-workflow.yml").read_text())
    steps = flow["jobs"]["review"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "bash kvspec/docs/ci/kvspec-review.sh base head" in runs
    assert "download.pytorch.org/whl/cpu" in runs and "[vllm]" in runs
    assert (CI / "kvspec-review.sh").is_file()
    usage = subprocess.run(["bash", str(CI / "kvspec-review.sh")], capture_output=True,
                           text=True, timeout=60)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_the_review_script_passes_its_budget_and_exit_code(tmp_path):
    """KVSPEC_EXAMPLES is a budget in runs (the same verdict on any runner) in
    place of KVSPEC_BUDGET; both set is refused; kvspec's exit code is the job's
    (a stand-in ``kvspec`` records what it was asked and answers a regression)."""
    fake = tmp_path / "kvspec"
    fake.write_text('#!/bin/sh\necho "$@" > "$KVSPEC_REPORTS/args"\nexit 1\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVSPEC_BUDGET", "KVSPEC_EXAMPLES", "KVSPEC_TIME_LIMIT")}
    env.update(KVSPEC=str(fake), KVSPEC_REPORTS=str(tmp_path), GITHUB_STEP_SUMMARY="")

    def review(**settings):
        return subprocess.run(["bash", str(CI / "kvspec-review.sh"), "installed", "pr.diff"],
                              capture_output=True, text=True, timeout=60,
                              env=dict(env, **settings))
    by_runs = review(KVSPEC_EXAMPLES="200")
    assert by_runs.returncode == 1 and "REGRESSION" in by_runs.stderr
    args = (tmp_path / "args").read_text().split()
    assert args[:5] == ["review", "installed", "pr.diff", "--examples", "200"], args
    assert "--budget" not in args
    by_time = review(KVSPEC_BUDGET="90s")
    assert by_time.returncode == 1
    assert (tmp_path / "args").read_text().split()[3:5] == ["--budget", "90s"]
    both = review(KVSPEC_BUDGET="90s", KVSPEC_EXAMPLES="200")
    assert both.returncode == 2 and "set one of them" in both.stderr
    # KVSPEC_TIME_LIMIT: the wall-clock safety net of a budget in runs, and only of one
    netted = review(KVSPEC_EXAMPLES="200", KVSPEC_TIME_LIMIT="30m")
    assert netted.returncode == 1
    assert (tmp_path / "args").read_text().split()[3:7] == ["--examples", "200",
                                                            "--time-limit", "30m"]
    bare = review(KVSPEC_TIME_LIMIT="30m")
    assert bare.returncode == 2 and "safety net of KVSPEC_EXAMPLES" in bare.stderr


def test_the_review_script_says_an_interrupted_review_is_no_verdict(tmp_path):
    fake = tmp_path / "kvspec"
    fake.write_text("#!/bin/sh\nexit 130\n")
    fake.chmod(0o755)
    done = subprocess.run(["bash", str(CI / "kvspec-review.sh"), "installed", "pr.diff"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, KVSPEC=str(fake), KVSPEC_REPORTS=str(tmp_path),
                                   GITHUB_STEP_SUMMARY="", KVSPEC_BUDGET="60s"))
    assert done.returncode == 130
    assert "kvspec-review: INTERRUPTED: a partial review, no verdict" in done.stderr


def test_the_hypofuzz_targets_run_as_plain_hypothesis_tests():
    """docs/ci/hypofuzz/: what HypoFuzz fuzzes for hours is a working Hypothesis test
    (HypoFuzz itself is not installed here; docs/ci/README.md says how it was tried)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-o", "addopts=", "-o", "testpaths=",
                           str(CI / "hypofuzz")], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", KVSPEC_HYPOFUZZ_EXAMPLES="5"),
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "passed" in done.stdout
