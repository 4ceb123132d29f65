"""``scripts/calibrate_vllm_tests.py --fixes`` (issue 26, part 4): a failure with
the fixes that the release shares is this machine's; one only the fixes cause
is either named by a packet (``changes_vllm_tests``) with its fix and why, or reported as
a fix's defect. Pure functions on pytest's printed summary; no vLLM needed."""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "calibrate_vllm_tests.py"


def load():
    spec = importlib.util.spec_from_file_location("calibrate_vllm_tests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failure_only_the_fixes_cause_is_named_or_reported(tmp_path):
    calibrate = load()
    contradicted = next(iter(calibrate.get_fix_contradicts()))
    shard = tmp_path / "fixes0.txt"
    shard.write_text("\n".join([
        "..F.F.F", f"FAILED {contradicted} - AssertionError: 0 != 800",
        "FAILED tests/a.py::test_machine - ImportError: torchvision",
        "ERROR tests/b.py::test_broken[x] - AttributeError",
        # a captured log line, not a test: once read as one, it made the release's
        # rerun of every failure stop at "file not found" and pass nothing
        "ERROR    vllm.model_executor.models.registry:registry.py:1164 Error in inspecting",
        "3 failed, 1175 passed, 4 skipped, 1 error, 2 subtests passed in 12.0s"]))
    counts, failed = calibrate.read_summaries([shard, tmp_path / "missing.txt"])
    assert counts == Counter(failed=3, passed=1175, skipped=4, error=1)
    assert failed == sorted([contradicted, "tests/a.py::test_machine", "tests/b.py::test_broken[x]"])
    # the release passes the contradicted test and test_broken, fails test_machine
    data = calibrate.judge_fixes(counts, failed, {"passed_without": [
        contradicted, "tests/b.py::test_broken[x]"]})
    assert data["failed_on_the_release_too"] == ["tests/a.py::test_machine"]
    assert list(data["contradicted_on_purpose"]) == [contradicted]
    assert data["broken_by_a_fix"] == ["tests/b.py::test_broken[x]"]
    data["applied"] = ["recovery-cuts-every-request-at-its-first-failed-block"]
    page = calibrate.render_fixes("0.0.0", data, 1.0)
    assert "**broken by a fix (a defect of the fix): 1**" in page
    assert calibrate.get_fix_contradicts()[contradicted][1] in page


def test_every_contradiction_names_a_fix_kvspec_has():
    calibrate = load()
    fixes = {p.stem.split("@")[0] for p in
             (SCRIPT.parents[1] / "kvspec" / "harness" / "patches" / "fixes").glob("*.diff")}
    assert {fix for fix, _ in calibrate.get_fix_contradicts().values()} <= fixes
