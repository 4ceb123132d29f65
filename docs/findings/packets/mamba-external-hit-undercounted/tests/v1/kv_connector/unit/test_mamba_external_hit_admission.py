# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Admission of a request with a synchronous external hit on an align-mode
Mamba group must count every block its first allocation takes: the block the
hit's state is loaded into and the block the first chunk's state goes to."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.request import RequestStatus

from .utils import (
    MockKVConnector,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)

BLOCK_SIZE = 16


pytestmark = pytest.mark.cpu_test


class HMAMockKVConnector(MockKVConnector, SupportsHMA):
    """MockKVConnector that also takes the block ids of every KV cache group."""

    def request_finished_all_groups(self, request, block_ids):
        return False, None


def _schedule_once(
    num_free_blocks: int,
    max_num_batched_tokens: int,
    num_prompt_tokens: int = 3 * BLOCK_SIZE,
    num_external_tokens: int = BLOCK_SIZE,  # the hit ends on a block boundary
    is_async: bool = False,
    reserve_full_isl: bool = True,
):
    vllm_config = create_vllm_config(
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_connector="HMAMockKVConnector",
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        kv_connector_extra_config={
            "matched_tokens": num_external_tokens,
            "is_async": is_async,
        },
        disable_hybrid_kv_cache_manager=False,
    )
    vllm_config.scheduler_config.scheduler_reserve_full_isl = reserve_full_isl
    kv_cache_config = make_kv_cache_config(
        block_size=BLOCK_SIZE,
        mamba_enabled=True,
        mamba_cache_mode="align",
        num_blocks=num_free_blocks + 1,  # and the null block
    )
    scheduler = create_scheduler(vllm_config, kv_cache_config=kv_cache_config)
    request = create_request(num_tokens=num_prompt_tokens, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    try:
        output = scheduler.schedule()
    except ValueError as e:
        pytest.fail(
            f"schedule() admitted the request with {num_free_blocks} free blocks, "
            f"then its allocation ran out of blocks: {e}"
        )
    return scheduler, request, output


@pytest.mark.parametrize(
    "num_prompt_tokens,num_external_tokens,max_num_batched_tokens,"
    "reserve_full_isl,num_free_blocks",
    [
        # The first chunk (tokens 16-47) reaches the prompt's last block. Full
        # attention takes 3 blocks; Mamba takes the block of the loaded state
        # (position 15) and the block of the chunk's state (position 47), but
        # admission counts one: 4 counted, 5 taken.
        (48, 16, 64, True, 4),
        # A connector that loads all but the last prompt token (as MoRIIO's READ
        # mode and DecodeBenchConnector do), when that token starts a block.
        (33, 32, 64, True, 4),
        # A shorter first chunk (tokens 16-31) takes 2 + 2 blocks, 3 counted.
        # With scheduler_reserve_full_isl the full prompt's estimate (4) would
        # keep the pool from being this tight.
        (48, 16, 16, False, 3),
    ],
)
def test_sync_external_hit_admission_counts_mamba_state_blocks(
    num_prompt_tokens,
    num_external_tokens,
    max_num_batched_tokens,
    reserve_full_isl,
    num_free_blocks,
):
    kwargs = dict(
        max_num_batched_tokens=max_num_batched_tokens,
        num_prompt_tokens=num_prompt_tokens,
        num_external_tokens=num_external_tokens,
        reserve_full_isl=reserve_full_isl,
    )
    scheduler, request, output = _schedule_once(num_free_blocks, **kwargs)
    assert request.request_id not in output.num_scheduled_tokens
    assert request.status == RequestStatus.WAITING

    # One block more and the request fits.
    scheduler, request, output = _schedule_once(num_free_blocks + 1, **kwargs)
    assert request.status == RequestStatus.RUNNING
    assert output.num_scheduled_tokens == {
        request.request_id: min(
            max_num_batched_tokens, num_prompt_tokens - num_external_tokens
        )
    }
    _, mamba_blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    null_block_id = scheduler.kv_cache_manager.block_pool.null_block.block_id
    assert len([b for b in mamba_blocks if b != null_block_id]) == 2


def test_short_first_chunk_keeps_full_sequence_admission():
    """With scheduler_reserve_full_isl (the default), a first chunk that stops
    short of the prompt's last block is admitted as it is without the hit: the
    full-sequence estimate counts one Mamba state block for any request."""
    _, request, output = _schedule_once(num_free_blocks=4, max_num_batched_tokens=16)
    assert request.status == RequestStatus.RUNNING
    assert output.num_scheduled_tokens == {request.request_id: 16}


def test_async_external_hit_takes_one_mamba_block():
    """An async load allocates for the hit only (one full-attention block, one
    state block), as counted, even with no full-sequence estimate."""
    _, request, _ = _schedule_once(
        num_free_blocks=2,
        max_num_batched_tokens=64,
        is_async=True,
        reserve_full_isl=False,
    )
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
