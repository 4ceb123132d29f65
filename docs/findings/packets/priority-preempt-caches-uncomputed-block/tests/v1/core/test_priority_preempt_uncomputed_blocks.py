# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Priority preemption of a request already scheduled in the same step.

allocate_slots registers a chunk's full blocks in the prefix cache when it
allocates them, before the model writes their KV. When the priority policy
then picks a request scheduled earlier in the same step as the victim, the
victim leaves the step and its tokens are not computed: the blocks registered
for them must leave the prefix cache, or a later request (the victim resuming,
or any request with its prefix) is served KV nobody wrote.
"""

import pytest

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from .utils import EOS_TOKEN_ID, create_scheduler

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16


def _make_request(
    req_id: str, prompt_token_ids: list[int], priority: int, arrival_time: float
) -> Request:
    init_none_hash(sha256)
    sampling_params = SamplingParams(ignore_eos=True, max_tokens=16)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        priority=priority,
        arrival_time=arrival_time,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def _model_runner_output(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[1000] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def test_priority_preempt_of_scheduled_request_uncaches_its_new_blocks():
    # 10 usable blocks (block 0 is the null block). While two requests are
    # eligible, a prefill chunk is capped at 2 blocks.
    scheduler = create_scheduler(
        scheduling_policy="priority",
        enable_prefix_caching=True,
        max_num_batched_tokens=4 * BLOCK_SIZE,
        long_prefill_token_threshold=2 * BLOCK_SIZE,
        max_model_len=1024,
        num_blocks=11,
        block_size=BLOCK_SIZE,
    )
    block_pool = scheduler.kv_cache_manager.block_pool
    low = _make_request("low", [1] * 10 * BLOCK_SIZE, priority=1, arrival_time=0.0)
    high = _make_request("high", [2] * 2 * BLOCK_SIZE, priority=0, arrival_time=1.0)

    # Step 1: `low` alone computes 4 blocks.
    scheduler.add_request(low)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"low": 4 * BLOCK_SIZE}
    scheduler.update_from_output(output, _model_runner_output(output))

    # Step 2: `low` computes 2 more blocks, and `high` is admitted behind it
    # in `running` with its whole 2-block prompt. 2 blocks are left free.
    scheduler.add_request(high)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {
        "low": 2 * BLOCK_SIZE,
        "high": 2 * BLOCK_SIZE,
    }
    scheduler.update_from_output(output, _model_runner_output(output))
    assert low.num_computed_tokens == 6 * BLOCK_SIZE
    assert block_pool.get_num_free_blocks() == 2

    # Step 3: `low`'s next chunk (blocks 6 and 7) takes the 2 free blocks,
    # which allocate_slots caches at once. Then `high`'s first decode token
    # needs a block: the lowest-priority request, `low`, is preempted although
    # it was scheduled earlier in this step.
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"high": 1}
    assert low.status == RequestStatus.PREEMPTED

    # Only blocks 0-5 of `low` hold KV; blocks 6 and 7 were never written.
    never_written = [
        idx
        for idx in (6, 7)
        if block_pool.get_cached_block(low.block_hashes[idx], [0]) is not None
    ]
    assert not never_written, (
        f"blocks {never_written} of `low`, cached for a chunk that the "
        "preemption took out of the step, are in the prefix cache although "
        "nobody wrote their KV"
    )
    _, num_hit_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(low)
    assert num_hit_tokens <= 6 * BLOCK_SIZE, (
        f"`low` would resume with a {num_hit_tokens}-token prefix hit, past "
        f"the {6 * BLOCK_SIZE} tokens it computed"
    )
