# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""kv_load_failure_policy="recompute": no request may read a failed block, or a
block computed over it, before it is recomputed.

Recovery keeps the request that owns a failed block running and truncates it
to its first failed block. Until a request has recomputed the block, its KV is
garbage, so:

- a request of the same batch that shares the block must not be scheduled past
  it before someone has rewritten it (for instance once the owner is aborted
  before its recompute);
- the block, and every block after it, must not be served as a prefix-cache
  hit to a new request.

The tests check what requests are scheduled over and what a new request hits,
not how a fix makes sharers wait, so they hold for any correct design.
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


def _recompute_scheduler(num_external_tokens: dict[str, int]):
    scheduler = create_scheduler(create_vllm_config(kv_load_failure_policy="recompute"))
    scheduler.connector = create_mock_connector()
    scheduler.connector.get_num_new_matched_tokens.side_effect = (
        _make_get_num_new_matched_tokens(num_external_tokens)
    )
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    return scheduler


@pytest.mark.parametrize("invalid_block_idx", [0, 1])
def test_recompute_sharer_not_scheduled_over_failed_block(invalid_block_idx: int):
    block_size = 16
    # Both prompts are 4 blocks long and share their first 2 blocks.
    request1 = create_request(
        num_tokens=4 * block_size, common_prefix_len=2 * block_size
    )
    request2 = create_request(
        num_tokens=4 * block_size, common_prefix_len=2 * block_size
    )
    scheduler = _recompute_scheduler({request1.request_id: 3 * block_size})
    scheduler.add_request(request1)
    scheduler.add_request(request2)

    scheduler_output = scheduler.schedule()

    # Request 1 loads 3 blocks; request 2 hits request 1's first 2 blocks.
    assert scheduler_output.num_scheduled_tokens == {
        request1.request_id: block_size,
        request2.request_id: 2 * block_size,
    }
    (req1_block_ids,) = scheduler.kv_cache_manager.get_block_ids(request1.request_id)
    (req2_block_ids,) = scheduler.kv_cache_manager.get_block_ids(request2.request_id)
    assert req2_block_ids[:2] == req1_block_ids[:2]

    # The load of a block both requests hold failed.
    scheduler.update_from_output(
        scheduler_output,
        create_model_runner_output(
            [request1, request2],
            invalid_block_ids={req1_block_ids[invalid_block_idx]},
        ),
    )

    assert request1.status == RequestStatus.RUNNING
    assert request2.status == RequestStatus.RUNNING
    assert request1.num_computed_tokens == invalid_block_idx * block_size

    # The owner is aborted before it recomputes the failed block: nobody will
    # rewrite it but request 2 itself, so request 2's next chunk must start at
    # or before it.
    scheduler.finish_requests(request1.request_id, RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        scheduler_output = scheduler.schedule()
        if request2.request_id in scheduler_output.num_scheduled_tokens:
            break
        scheduler.update_from_output(scheduler_output, create_model_runner_output([]))
    num_scheduled = scheduler_output.num_scheduled_tokens.get(request2.request_id)
    assert num_scheduled is not None, "request 2 is never scheduled again"
    start = request2.num_computed_tokens - num_scheduled
    assert start <= invalid_block_idx * block_size, (
        f"request 2 is scheduled from token {start}, over block {invalid_block_idx} "
        "that failed to load and that nobody has recomputed"
    )


def test_recompute_failed_block_not_served_from_prefix_cache():
    block_size = 16
    request1 = create_request(num_tokens=4 * block_size)
    scheduler = _recompute_scheduler({request1.request_id: 3 * block_size})
    scheduler.add_request(request1)

    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {request1.request_id: block_size}
    (req1_block_ids,) = scheduler.kv_cache_manager.get_block_ids(request1.request_id)

    # Block 1 of the 3 loaded blocks failed; request 1 will recompute it.
    scheduler.update_from_output(
        scheduler_output,
        create_model_runner_output([request1], invalid_block_ids={req1_block_ids[1]}),
    )
    assert request1.status == RequestStatus.RUNNING
    assert request1.num_computed_tokens == block_size

    # Until it is recomputed, neither the failed block nor the blocks after it
    # hold valid KV, so a new request with the same prompt may hit block 0 only.
    def get_num_hit_tokens(request_id: str) -> int:
        request = Request(
            request_id=request_id,
            prompt_token_ids=request1.prompt_token_ids + [7],
            sampling_params=request1.sampling_params,
            pooling_params=None,
            block_hasher=get_request_block_hasher(block_size, sha256),
        )
        _, num_hit_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(request)
        return num_hit_tokens

    num_hit_tokens = get_num_hit_tokens("request2")
    assert num_hit_tokens <= block_size, (
        f"a new request extending request 1's prompt gets a {num_hit_tokens}-token prefix "
        f"hit: block ids {req1_block_ids[1:]} (indices 1-3), from the failed block "
        "on, are served from the prefix cache before being recomputed"
    )

    # The same once the client aborts request 1 before it recomputes the block.
    scheduler.finish_requests(request1.request_id, RequestStatus.FINISHED_ABORTED)
    num_hit_tokens = get_num_hit_tokens("request3")
    assert num_hit_tokens <= block_size, (
        f"after request 1 is aborted, a new request with its prompt gets a "
        f"{num_hit_tokens}-token prefix hit over the failed block id "
        f"{req1_block_ids[1]} (index 1)"
    )
