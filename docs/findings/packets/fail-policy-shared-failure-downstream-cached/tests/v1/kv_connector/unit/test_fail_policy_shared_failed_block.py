# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""kv_load_failure_policy="fail" (the default) with a failed block that two
requests of one batch share.

Request 1 loads its prompt synchronously; request 2, scheduled in the same
step, gets a local prefix hit on request 1's first blocks and computes two
blocks of its own on top of them. When the worker reports the shared first
block as failed, both requests end with FINISHED_ERROR, and every block whose
KV was computed over the failed block must leave the prefix cache, whichever
request holds it.
"""

from collections.abc import Callable

import pytest

from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request, RequestStatus

from .utils import (
    create_mock_connector,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test


def _make_get_num_new_matched_tokens(
    req_num_new_matched_tokens: dict[str, int],
) -> Callable[[Request, int], tuple[int, bool]]:
    def get_num_new_matched_tokens(request: Request, _: int) -> tuple[int, bool]:
        # Synchronous loads: the loaded blocks are cached at allocation.
        return req_num_new_matched_tokens.get(request.request_id, 0), False

    return get_num_new_matched_tokens


def test_fail_policy_evicts_sharer_blocks_computed_on_failed_block():
    scheduler = create_scheduler(create_vllm_config(kv_load_failure_policy="fail"))
    block_size = scheduler.block_size
    block_pool = scheduler.kv_cache_manager.block_pool

    # Both prompts are 4 blocks long and share their first 2 blocks.
    request1 = create_request(
        num_tokens=4 * block_size, common_prefix_len=2 * block_size
    )
    request2 = create_request(
        num_tokens=4 * block_size, common_prefix_len=2 * block_size
    )
    scheduler.add_request(request1)
    scheduler.add_request(request2)

    scheduler.connector = create_mock_connector()
    scheduler.connector.get_num_new_matched_tokens.side_effect = (
        _make_get_num_new_matched_tokens({request1.request_id: 3 * block_size})
    )
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()

    scheduler_output = scheduler.schedule()

    # Request 1 loads 3 blocks and computes its last one; request 2 hits
    # request 1's first 2 blocks and computes blocks 2 and 3 on top of them.
    assert scheduler_output.num_scheduled_tokens == {
        request1.request_id: block_size,
        request2.request_id: 2 * block_size,
    }
    (req1_block_ids,) = scheduler.kv_cache_manager.get_block_ids(request1.request_id)
    (req2_block_ids,) = scheduler.kv_cache_manager.get_block_ids(request2.request_id)
    assert req2_block_ids[:2] == req1_block_ids[:2]
    for idx in (2, 3):
        assert block_pool.get_cached_block(request2.block_hashes[idx], [0])

    # The load of the first block, shared by both requests, failed.
    failed_block_id = req1_block_ids[0]
    scheduler.update_from_output(
        scheduler_output,
        create_model_runner_output(
            [request1, request2], invalid_block_ids={failed_block_id}
        ),
    )
    assert request1.status == RequestStatus.FINISHED_ERROR
    assert request2.status == RequestStatus.FINISHED_ERROR

    # Every block computed over the failed block must leave the prefix cache:
    # request 1's (evicted as released) and request 2's alike.
    for idx in range(4):
        assert block_pool.get_cached_block(request1.block_hashes[idx], [0]) is None
    stale = [
        req2_block_ids[idx]
        for idx in (2, 3)
        if block_pool.get_cached_block(request2.block_hashes[idx], [0]) is not None
    ]
    assert not stale, (
        f"blocks {stale} of request 2, computed over the failed block "
        f"{failed_block_id}, are still in the prefix cache"
    )

    # Why it matters: once another request recomputes the shared prefix, its
    # hash is cached again, and a prompt extending request 2's would be served
    # request 2's blocks, whose KV was computed over the failed block.
    request3 = create_request(
        num_tokens=3 * block_size, common_prefix_len=2 * block_size
    )
    scheduler.add_request(request3)
    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {
        request3.request_id: 3 * block_size
    }
    scheduler.update_from_output(
        scheduler_output, create_model_runner_output([request3], use_eos=True)
    )
    assert block_pool.get_cached_block(request2.block_hashes[1], [0])

    request4 = Request(
        request_id="request4",
        prompt_token_ids=request2.prompt_token_ids + [7],
        sampling_params=request2.sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    _, num_hit_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(request4)
    assert num_hit_tokens == 2 * block_size, (
        f"a new request with request 2's prompt gets a {num_hit_tokens}-token "
        f"prefix hit; past the recomputed {2 * block_size}-token prefix it "
        "reads request 2's blocks, computed over the failed block"
    )
