"""Every claim earns its keep: witnessed in a default check, reported in one JSON
object, safety apart from vLLM's design rules, and every transition the
reference makes admitted by the model Z3 proves over."""
from __future__ import annotations

import json

import attrs

import pytest
from typer.testing import CliRunner

from kvspec.cli import app
from kvspec.harness.fuzz import fuzz
from kvspec.harness.runner import FEATURES, Counterexample, Runner
from kvspec.harness.target import make_config
from kvspec.spec.conformance import Hints, ModelBook, ModelStep
from kvspec.spec.registry import REGISTRY

#: what `kvspec check --json` must carry (issue 9)
JSON_KEYS = {"target", "version", "seed", "budget_s", "runs", "actions", "claims", "features",
             "profile", "verdict"}
REQUIRED_FEATURES = {"load_failures", "async_loads", "preemptions", "spec_decode",
                     "failure_policy_recompute", "failure_policy_fail", "policy_fcfs",
                     "policy_priority", "sends", "prefix_cache_resets"}


@pytest.fixture(scope="module")
def impl_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("check")
    # seed 2 draws every required feature and witnesses every claim within about
    # 900 actions, a tenth of what 25 s runs on a quiet 2-core machine (seed 9
    # needed more than 3,000 once the environment drew two block sizes: under the
    # suite's load failed_block_recomputed_once went unwitnessed)
    result = CliRunner().invoke(app, ["check", "--budget", "25s", "--seed", "2", "--json",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_check_json_is_one_object_with_the_promised_fields(impl_report):
    assert JSON_KEYS <= set(impl_report)
    assert impl_report["target"] == "impl" and impl_report["verdict"] == "hold"
    assert impl_report["runs"] > 0 and impl_report["actions"] > 0
    assert REQUIRED_FEATURES <= set(impl_report["features"]) == set(FEATURES)
    names = [c["name"] for c in impl_report["claims"]]
    assert names == list(REGISTRY)
    for claim in impl_report["claims"]:
        assert {"name", "kind", "checked", "witnessed", "violations"} <= set(claim)


def test_every_claim_is_witnessed_on_the_reference_or_says_why(impl_report):
    unwitnessed = {c["name"] for c in impl_report["claims"] if not c["witnessed"]}
    excused = {name for name, inv in REGISTRY.items() if inv.unwitnessed_because}
    assert unwitnessed == excused == set(impl_report["unwitnessed"])
    assert all(impl_report["unwitnessed"].values())  # each with its reason


def test_every_feature_is_exercised_on_the_reference(impl_report):
    missing = sorted(f for f in REQUIRED_FEATURES if not impl_report["features"][f])
    assert not missing, (missing, impl_report["actions"], impl_report["features"])


def test_a_claim_whose_antecedent_never_holds_is_not_witnessed():
    """placeholders_nonnegative is checked on every state but witnessed by none:
    with no async scheduling, no request ever has a placeholder."""
    runner = Runner("impl", make_config())
    runner.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3], "max_tokens": 2})
    runner.apply({"op": "drain"})
    assert runner.checks["placeholders_nonnegative"] > 0
    assert runner.witnessed["placeholders_nonnegative"] == 0
    assert runner.witnessed["running_request_has_stats"] > 0


def test_claims_have_a_role_and_design_rules_are_named():
    design = {name for name, inv in REGISTRY.items() if inv.role == "design"}
    assert design == {"failed_block_recomputed_once", "long_prefill_cap",
                      "preemption_victim_follows_policy", "preemption_stops_at_fenced_victim"}


@pytest.mark.parametrize("name", ["conservative_recovery", "largest_victim"])
def test_alternative_designs_pass_every_safety_claim(name, tmp_path):
    """A correct scheduler that chooses differently from vLLM (recover from block
    0; preempt the request holding the most blocks) passes the safety claims;
    with design rules on, only the rule it breaks on purpose objects."""
    from kvspec.impl.alternatives import ALTERNATIVES
    target = f"alt:{name}"
    safe = fuzz(target, budget=10, seed=1, out_dir=tmp_path, design_rules=False)
    assert safe.counterexample is None, [str(v) for v in safe.counterexample.violations]
    # a budget in runs, not seconds: under load a 40 s budget once ran out first
    # (seed 1 breaks the rule after about 16 s of runs on an idle 2-core machine)
    ruled = fuzz(target, budget=0, seed=1, out_dir=tmp_path, max_examples=3000)
    assert ruled.counterexample is not None, f"{target} never broke {ALTERNATIVES[name].breaks}"
    assert {v.invariant for v in ruled.counterexample.violations} <= set(
        ALTERNATIVES[name].breaks)


def test_conservative_recovery_exercises_failures(tmp_path):
    safe = fuzz("alt:conservative_recovery", budget=10, seed=2, out_dir=tmp_path,
                design_rules=False)
    assert safe.features["load_failures"] > 0 and safe.counterexample is None


def test_stats_lowering_is_a_choice():
    """Recovery that keeps the stats (vLLM 0.32) or lowers only the external count
    passes; raising them does not."""
    from kvspec.spec.predicates import is_admissible_lowering
    assert is_admissible_lowering(6, 4, 6, 4)      # kept
    assert is_admissible_lowering(6, 4, 6, 1)      # external only
    assert is_admissible_lowering(6, 4, 2, 0)      # both (the reference)
    assert not is_admissible_lowering(6, 4, 2, 4)  # cached below external
    assert not is_admissible_lowering(6, 4, 7, 4)  # raised


# -- conformance to the model ------------------------------------------------

def _step(before_computed: int, after_computed: int, scheduled: int, start=None,
          failed_block=None, recoveries: int = 0) -> list[str]:
    """One RUNNING request's step as the conformance claim sees it."""
    import attrs
    from kvspec.spec.conformance import INITIAL_GHOST
    from kvspec.spec.state import RequestStatus
    runner = Runner("impl", make_config(block_size=2))
    runner.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 3})
    before = runner.obs
    running = attrs.evolve(before.requests["r0"], status=RequestStatus.RUNNING,
                           num_computed_tokens=before_computed, num_cached_tokens=0,
                           num_external_computed_tokens=0, block_ids=((0, 1, 2, 3),))
    moved = attrs.evolve(running, num_computed_tokens=after_computed)
    ghost = dict(INITIAL_GHOST, num_stats_sets=1, num_recoveries=recoveries,
                 num_resume_limit=6 if recoveries else 0)
    hints = Hints(num_new=scheduled, start=before_computed if start is None else start,
                  first_invalid_block=failed_block)
    step = ModelStep("step", attrs.evolve(before, requests={"r0": running}),
                     attrs.evolve(before, requests={"r0": moved}), {"r0": hints},
                     ModelBook({"r0": ghost}))
    return list(REGISTRY["transition_admitted_by_model"].check(step))


def test_conformance_admits_a_chunk_and_rejects_a_jump():
    assert _step(2, 4, scheduled=2) == []          # a chunk of 2: compute + keep_prefilling
    assert _step(2, 5, scheduled=2)                # grew by 3 with 2 scheduled: no shape


def test_an_undisturbed_request_cannot_skip_a_token():
    """Resuming past the computed prefix is for requests a failure cut back."""
    assert _step(2, 5, scheduled=2, start=3)                  # never recovered: a skip
    assert _step(2, 5, scheduled=2, start=3, recoveries=1) == []  # a waiter resuming


def test_a_failed_block_under_the_prefix_must_be_recovered():
    """A step that reports a failed block under a running request's prefix and
    leaves its count standing is not admitted, whatever else fits."""
    assert _step(4, 6, scheduled=2, failed_block=0)
    assert _step(4, 0, scheduled=2, failed_block=0) == []     # cut back to 0: recovered


def test_a_stale_output_must_recover_only_what_no_later_step_rewrites():
    """A stale output's failed block (its request was cut back since) binds the
    request only under what it counts that no later step in flight writes
    again: those writes land after the failed load. DecodeBenchConnector's
    trace (model_tests/connectors/) met the case: r1 cut to 0, rescheduled
    from 0, then its old step's failure at block index 1 reported."""
    from kvspec.spec.conformance import must_recover
    from kvspec.spec.effects import RUNNING, Counters
    before = Counters(status=RUNNING, prompt_len=5, num_tokens=5, num_computed=4, num_cached=4,
                      num_external=2, num_preemptions=0, num_blocks=4, block_size=2,
                      num_placeholders=0, num_stats_sets=1, num_recoveries=1,
                      num_resume_limit=0)
    stale = Hints(num_new=3, first_invalid_block=1, stale=True)
    assert must_recover(before, stale)                                  # nothing rewrites it
    assert not must_recover(before, attrs.evolve(stale, rewritten_from=0))   # recomputed after
    assert must_recover(before, attrs.evolve(stale, rewritten_from=3))  # a hit under 3 stays


def test_async_load_counted_short_breaks_conformance(tmp_path):
    """The conformance claim alone catches it (other claims may see it first)."""
    result = fuzz("mutant:async_load_counted_short", budget=30, seed=0, out_dir=tmp_path,
                  kinds=("model",))
    assert result.counterexample is not None
    assert "transition_admitted_by_model" in {v.invariant for v in result.counterexample.violations}


def test_the_reference_makes_only_admitted_transitions_in_a_long_trace():
    runner = Runner("impl", make_config(block_size=2, num_blocks=10, max_num_batched_tokens=6,
                                        long_prefill_token_threshold=3))
    actions = [{"op": "add", "id": "r0", "prompt": list(range(1, 10)), "max_tokens": 3, "ext": 5,
                "async": True},
               {"op": "add", "id": "r1", "prompt": list(range(1, 8)), "max_tokens": 2, "ext": 4},
               {"op": "step", "fail": ["r1"]}, {"op": "step", "finish_loads": ["r0"]},
               {"op": "step", "drafts": 2}, {"op": "step", "accept": 1}, {"op": "drain"}]
    try:
        for action in actions:
            runner.apply(action)
    except Counterexample as exc:
        pytest.fail("; ".join(map(str, exc.violations)))
    assert runner.features["load_failures"] == 1 and runner.features["async_loads"] == 1
    assert runner.witnessed["transition_admitted_by_model"] >= 6


def test_the_oracle_gives_a_position_past_every_token_no_valid_content():
    """A broken scheduler may compute a position no token is at; the oracle
    records content no valid slot holds (the claims say what is wrong)
    instead of crashing first when only some kinds of claims are checked."""
    from kvspec.spec.oracle import UNDEFINED_CONTENT, get_content
    keys = ["k0", "k1"]
    assert get_content(0, keys, 1) == "k1" and get_content(1, keys, 1) == (1, "k1")
    assert get_content(0, keys, 2) == get_content(1, keys, 5) == UNDEFINED_CONTENT
    assert UNDEFINED_CONTENT not in keys


def test_the_largest_victim_design_keeps_every_request_going():
    """Regression (found by a CI run, 2026-11-23): preempting the request with the
    most blocks, the oldest included, let three requests of a hybrid layout
    preempt each other until the healed phase ended with them still running.
    The design now spares the oldest running request."""
    from kvspec.harness.machine import make_groups
    config = make_config(block_size=2, num_blocks=19, max_num_batched_tokens=4, max_num_seqs=4,
                         max_model_len=12, long_prefill_token_threshold=1,
                         async_scheduling=True, groups=make_groups("sliding+state", 2, 5))
    actions = [
        {"op": "add", "id": "r0", "prompt": [2, 4, 6, 1], "max_tokens": 2, "ext": 2},
        {"op": "add", "id": "r1", "prompt": [2, 4, 6, 1, 17], "max_tokens": 2},
        {"op": "add", "id": "r2", "prompt": [2, 4, 6, 1, 24, 25, 26], "max_tokens": 2},
        {"op": "add", "id": "r3", "prompt": [1, 2, 3, 4, 31], "max_tokens": 2, "ext": 2,
         "async": True},
        {"op": "add", "id": "r4", "prompt": [1, 2, 3, 4, 38, 39], "max_tokens": 2},
        {"op": "drain"}]
    runner = Runner("alt:largest_victim", config, design_rules=False)
    failure = runner.run(actions)
    assert failure is None, [str(v) for v in failure.violations]
    assert runner.features["preemptions"] > 0


@pytest.mark.parametrize("mutant", ["draft_count_ignores_placeholders",
                                    "placeholder_snapshot_before_increment"])
def test_conformance_alone_catches_async_only_bugs(tmp_path, mutant):
    """Async steps are inside the model (a schedule, then the oldest step's
    output): bugs that exist only under async scheduling break it with every
    other claim switched off (issue 25, part 2)."""
    result = fuzz(f"mutant:{mutant}", budget=12, seed=0, out_dir=tmp_path, kinds=("model",))
    assert result.counterexample is not None
    assert {v.invariant for v in result.counterexample.violations} == {
        "transition_admitted_by_model"}


def test_check_json_lists_no_step_outside_the_model(impl_report):
    """Every step a target makes is evaluated: async ones and every group."""
    assert impl_report["features"]["async_scheduling"] > 0
    assert impl_report["not_evaluated"] == {}
    model = next(c for c in impl_report["claims"] if c["name"] == "transition_admitted_by_model")
    assert model["checked"] > 0 and model["witnessed"] > 0 and model["violations"] == 0
