# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV load failure recovery ("recompute") under async scheduling.

A synchronous KV load fails in step 1. By the time step 1's output reports it,
the scheduler has already dispatched step 2 for the same request (the batch
queue runs one step ahead), so step 2 was computed on top of the failed block
too. Recovery cuts the request back to its first failed block; everything it
has in flight must then be dropped, and no placeholder of it may be counted.
"""

import pytest

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from .utils import (
    create_mock_connector,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test


def _create_async_scheduler(
    num_external_tokens: int, num_speculative_tokens: int | None = None
) -> AsyncScheduler:
    vllm_config = create_vllm_config(
        kv_load_failure_policy="recompute",
        num_speculative_tokens=num_speculative_tokens,
    )
    # The scheduler logic under test does not depend on the platform; only the
    # engine's batch queue does, which the test plays by hand.
    vllm_config.scheduler_config.async_scheduling = True
    scheduler = create_scheduler(vllm_config)
    assert isinstance(scheduler, AsyncScheduler)

    # A connector that loads synchronously (in the step that computes on it)
    # and can report the blocks it failed to load.
    scheduler.connector = create_mock_connector()
    scheduler.connector.get_num_new_matched_tokens.side_effect = (
        lambda request, num_computed_tokens: (num_external_tokens, False)
    )
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    return scheduler


def _output(
    request: Request,
    scheduler_output: SchedulerOutput,
    sampled: list[int],
    invalid_block_ids: set[int] | None = None,
) -> ModelRunnerOutput:
    assert request.request_id in scheduler_output.num_scheduled_tokens
    output = create_model_runner_output([request], invalid_block_ids=invalid_block_ids)
    output.sampled_token_ids = [sampled]
    return output


def _delivered(outputs: dict[int, EngineCoreOutputs], request: Request) -> list[int]:
    return [
        token_id
        for engine_core_outputs in outputs.values()
        for output in engine_core_outputs.outputs
        if output.request_id == request.request_id
        for token_id in output.new_token_ids
    ]


def test_recompute_drops_output_in_flight():
    scheduler = _create_async_scheduler(num_external_tokens=32)
    # 2 full blocks load from the connector, the last 8 tokens are computed.
    request = create_request(num_tokens=40, max_tokens=4)
    scheduler.add_request(request)

    step1 = scheduler.schedule()
    assert step1.num_scheduled_tokens[request.request_id] == 8
    # The batch queue dispatches step 2 (the first decode) before step 1's
    # output is back.
    step2 = scheduler.schedule()
    assert step2.num_scheduled_tokens[request.request_id] == 1

    # Step 1's output reports that the first loaded block failed to load.
    (block_ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    scheduler.update_from_output(
        step1, _output(request, step1, [101], invalid_block_ids={block_ids[0]})
    )
    assert request.num_computed_tokens == 0

    # The engine schedules step 3 (the recompute) before step 2's output
    # returns.
    step3 = scheduler.schedule()
    outputs = scheduler.update_from_output(step2, _output(request, step2, [102]))

    assert _delivered(outputs, request) == [] and request.num_output_tokens == 0, (
        "step 2 ran on top of the block that failed to load; its token "
        f"{list(request.output_token_ids)} was delivered instead of dropped"
    )
    assert step3.num_scheduled_tokens[request.request_id] == request.num_tokens, (
        "the recompute after the cut must cover exactly the prompt; "
        f"{step3.num_scheduled_tokens[request.request_id]} positions were "
        f"scheduled for {request.num_tokens} tokens, counting the placeholders "
        "of the steps computed on the failed KV"
    )

    outputs = scheduler.update_from_output(step3, _output(request, step3, [103]))
    assert _delivered(outputs, request) == [103]
    assert request.num_output_placeholders == 0
    assert request.num_computed_tokens == request.num_tokens - 1


def test_recompute_with_drafts_drops_output_in_flight():
    """As above with speculative decoding, where step 2 verifies two
    placeholder drafts and one is accepted, and the recompute is clipped by the
    token budget (64): it may only be scheduled as a prefill."""
    scheduler = _create_async_scheduler(
        num_external_tokens=32, num_speculative_tokens=2
    )
    request = create_request(num_tokens=63, max_tokens=8)
    scheduler.add_request(request)

    step1 = scheduler.schedule()
    assert step1.num_scheduled_tokens[request.request_id] == 31
    step2 = scheduler.schedule()
    assert step2.scheduled_spec_decode_tokens[request.request_id] == [-1, -1]

    (block_ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    scheduler.update_from_output(
        step1, _output(request, step1, [101], invalid_block_ids={block_ids[0]})
    )
    assert request.num_computed_tokens == 0

    step3 = scheduler.schedule()
    # Step 2's output: its sampled token and one accepted draft.
    outputs = scheduler.update_from_output(step2, _output(request, step2, [102, 103]))

    assert _delivered(outputs, request) == [] and request.num_output_tokens == 0, (
        "step 2 ran on top of the block that failed to load; its tokens "
        f"{list(request.output_token_ids)} were delivered instead of dropped"
    )
    assert step3.num_scheduled_tokens[request.request_id] == request.num_tokens, (
        "the recompute after the cut must cover exactly the prompt; "
        f"{step3.num_scheduled_tokens[request.request_id]} positions were "
        f"scheduled for {request.num_tokens} tokens"
    )
    assert request.request_id not in step3.scheduled_spec_decode_tokens, (
        "the recompute verified the placeholder drafts of a step computed on "
        "the failed KV"
    )

    outputs = scheduler.update_from_output(step3, _output(request, step3, [104]))
    assert _delivered(outputs, request) == [104]
    assert request.num_output_placeholders == 0
