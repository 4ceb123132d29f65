# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""reset_prefix_cache(reset_running_requests=True) while a step is in flight,
under async scheduling with a consumer KV connector.

Such a scheduler defers the return of a request's blocks to the pool until the
step in flight that may still write them is processed. Preempting the running
requests therefore frees nothing at once, and the block pool refuses the reset.
A forced reset must then either fail having changed nothing (the requests still
run and the cache still hits) or succeed with an empty cache; it must not raise
after preempting them. Once no step is in flight, the forced reset succeeds.
"""

import pytest

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from .utils import create_requests, create_scheduler, mock_kv

pytestmark = pytest.mark.cpu_test


def _model_runner_output(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[0] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def test_forced_reset_with_step_in_flight():
    scheduler = create_scheduler(
        async_scheduling=True,
        enable_prefix_caching=True,
        use_kv_connector=mock_kv(matched_tokens=0, is_async=False),
        kv_role="kv_both",
    )
    # The production gate (a consumer connector with overlapping batches) is
    # off on CPU, where async scheduling is disabled; force it.
    scheduler.defer_block_free = True
    manager = scheduler.kv_cache_manager

    request, probe = create_requests(
        num_requests=2, num_tokens=40, max_tokens=8, same_prompt=True
    )
    scheduler.add_request(request)
    step1 = scheduler.schedule()
    # Step 1 is in flight: its output has not been processed yet.

    try:
        reset = scheduler.reset_prefix_cache(reset_running_requests=True)
    except RuntimeError as e:
        pytest.fail(
            "a forced prefix-cache reset with a step in flight raised after "
            f"preempting every running request: {e}"
        )
    if reset:
        # A reset that reports success left no block to hit.
        assert manager.get_computed_blocks(probe)[1] == 0
    else:
        # A reset that reports failure changed nothing.
        assert request.status == RequestStatus.RUNNING, (
            "the reset failed, yet it preempted the running request"
        )
        assert not scheduler.deferred_frees
        assert manager.get_computed_blocks(probe)[1] == 32

    # Once the step's output is processed, nothing is in flight: a forced
    # reset succeeds.
    scheduler.update_from_output(step1, _model_runner_output(step1))
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert request.status == RequestStatus.PREEMPTED
    assert manager.get_computed_blocks(probe)[1] == 0
