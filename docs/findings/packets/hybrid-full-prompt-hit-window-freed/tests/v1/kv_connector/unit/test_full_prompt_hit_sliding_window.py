# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An async external hit of the whole prompt is resumed one token early (the
last prompt token is recomputed to sample), so its first allocation must keep
the attention window of that token, not of the token after the prompt.

The P/D connectors (NIXL, Mooncake) avoid the whole-prompt hit for sliding
windows as they do for Mamba: the prefill node stops one token short and the
decode node computes the last token with a window laid out for it."""

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.request import RequestStatus

from .utils import (
    MockKVConnector,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
SLIDING_WINDOW = 32



class HMAMockKVConnector(MockKVConnector, SupportsHMA):
    """MockKVConnector that also takes the block ids of every KV cache group."""

    def request_finished_all_groups(self, request, block_ids):
        return False, None


def _make_scheduler(
    num_prompt_tokens: int,
    mamba: bool = False,
    num_blocks: int = 100,
    kv_connector: str = "HMAMockKVConnector",
    kv_role: str = "kv_both",
):
    mock = kv_connector == "HMAMockKVConnector"
    vllm_config = create_vllm_config(
        block_size=BLOCK_SIZE,
        kv_connector=kv_connector,
        kv_connector_module_path=__name__ if mock else None,
        kv_role=kv_role,
        kv_connector_extra_config={
            # The external store holds the whole prompt; the load is async.
            "matched_tokens": num_prompt_tokens,
            "is_async": True,
        }
        if mock
        else None,
        disable_hybrid_kv_cache_manager=False,
    )
    kv_cache_config = make_kv_cache_config(
        block_size=BLOCK_SIZE,
        swa_enabled=not mamba,
        sw_size=SLIDING_WINDOW,
        mamba_enabled=mamba,
        mamba_cache_mode="align",
        num_blocks=num_blocks,
    )
    return create_scheduler(vllm_config, kv_cache_config=kv_cache_config)


# 47 ≡ SLIDING_WINDOW - 1 (mod BLOCK_SIZE): counted from the end of the prompt,
# the window starts on a block boundary and the block before it is skipped,
# though the recomputed token at position 46 reads position 15 in it.
@pytest.mark.parametrize("num_prompt_tokens", [46, 47, 48])
def test_full_prompt_async_hit_keeps_recomputed_token_window(num_prompt_tokens):
    scheduler = _make_scheduler(num_prompt_tokens)
    request = create_request(num_tokens=num_prompt_tokens, block_size=BLOCK_SIZE)
    _load_then_compute_last_token(scheduler, request)
    _assert_window_is_real(scheduler, request, num_prompt_tokens)


# The decode node of a P/D pair: the connector asks the prefill node for the
# prompt. Loading all of it would need the same rewind as above; stopping one
# token short lets the decode node compute the last token as a plain prefill.
@pytest.mark.parametrize("kv_connector", ["NixlConnector", "MooncakeConnector"])
@pytest.mark.parametrize("num_prompt_tokens", [46, 47, 48])
def test_pd_decode_node_computes_last_token_with_its_window(
    kv_connector, num_prompt_tokens
):
    scheduler = _make_scheduler(
        num_prompt_tokens, kv_connector=kv_connector, kv_role="kv_consumer"
    )
    request = create_request(
        num_tokens=num_prompt_tokens,
        block_size=BLOCK_SIZE,
        do_remote_prefill=True,
        num_remote_blocks=num_prompt_tokens // BLOCK_SIZE + 1,
    )
    num_loaded = _load_then_compute_last_token(scheduler, request)
    assert num_loaded == num_prompt_tokens - 1, (
        f"the decode node loaded {num_loaded} of "
        f"{num_prompt_tokens} prompt tokens; with a sliding-window group it "
        f"must stop one short, as for Mamba"
    )
    _assert_window_is_real(scheduler, request, num_prompt_tokens)


@pytest.mark.parametrize("kv_connector", ["NixlConnector", "MooncakeConnector"])
def test_pd_prefill_node_stops_one_token_short_for_window_groups(kv_connector):
    scheduler = _make_scheduler(47, kv_connector=kv_connector, kv_role="kv_producer")
    request = create_request(
        num_tokens=47, block_size=BLOCK_SIZE, do_remote_decode=True
    )
    scheduler.add_request(request)
    assert request.num_prompt_tokens == 46
    assert request.kv_transfer_params["_p_side_truncated"] is True

    # The connector is told of the request again (as by a second add_request):
    # it must not lose another token.
    scheduler.connector.on_new_request(request)
    assert request.num_prompt_tokens == 46


def _load_then_compute_last_token(scheduler, request) -> int:
    """Returns the number of tokens the load was issued for."""
    scheduler.add_request(request)

    # Step 1: the load is issued; nothing is computed.
    output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert output.num_scheduled_tokens == {}
    num_loaded = request.num_computed_tokens
    scheduler.update_from_output(
        output,
        create_model_runner_output([], finished_recving={request.request_id}),
    )

    # Step 2: the load finished; the last prompt token is computed.
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {request.request_id: 1}
    return num_loaded


def _assert_window_is_real(scheduler, request, num_prompt_tokens):
    null_block_id = scheduler.kv_cache_manager.block_pool.null_block.block_id
    position = num_prompt_tokens - 1
    first_read = position - SLIDING_WINDOW + 1

    _, window_blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    read = range(first_read // BLOCK_SIZE, position // BLOCK_SIZE + 1)
    null_blocks = [i for i in read if window_blocks[i] == null_block_id]
    assert not null_blocks, (
        f"the token at position {position} attends positions {first_read}.."
        f"{position} in the sliding-window group, but block(s) {null_blocks} of "
        f"its table {window_blocks} are the null block: the first allocation "
        f"skipped blocks from {num_prompt_tokens} computed tokens, the request "
        f"resumed from {position}"
    )


def test_full_prompt_async_hit_leaves_mamba_state_blocks_alone():
    """A Mamba group's hit is the state after the hit's last token, the one
    that is loaded. Resuming one token early must not give the group a block
    for an earlier state: nothing writes it, and prefix caching would offer it
    to later requests as the state of the prefix it ends."""
    num_prompt_tokens = 2 * BLOCK_SIZE + 1  # positions 31 and 32: two blocks
    # Full attention takes 3 blocks and Mamba 1; the pool's 6th is its null block.
    scheduler = _make_scheduler(num_prompt_tokens, mamba=True, num_blocks=5)
    null_block_id = scheduler.kv_cache_manager.block_pool.null_block.block_id
    request = create_request(num_tokens=num_prompt_tokens, block_size=BLOCK_SIZE)
    scheduler.add_request(request)

    try:
        scheduler.schedule()
    except ValueError as e:
        pytest.fail(f"schedule() took more blocks than admission counted: {e}")
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, (
        f"a full-prompt hit that fits in 4 free blocks was not admitted: "
        f"{request.status.name}"
    )
    _, mamba_blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    state_blocks = [b for b in mamba_blocks if b != null_block_id]
    assert len(state_blocks) == 1, (
        f"the Mamba group holds {len(state_blocks)} blocks {mamba_blocks} for a "
        f"hit whose only state is the one after its last token"
    )
