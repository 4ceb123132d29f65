# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An async external hit of the whole prompt is resumed one token early (the
last prompt token is recomputed to sample), so its first allocation must keep
the attention window of that token, not of the token after the prompt.

The P/D connectors (NIXL, Mooncake) avoid the whole-prompt hit for sliding
windows as they do for Mamba: the prefill node stops one token short and the
decode node computes the last token with a window laid out for it."""

from types import SimpleNamespace

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


# P/D: the prefill node hands over its blocks, the decode node pulls into its
# own, and the worker pairs the two lists from the tail
# (NixlBaseConnectorWorker._apply_prefix_caching for pull and push; Mooncake's
# sender keeps local_group[-n_remote:]). Every position the decode node's first
# computed token reads must land in a block filled from the prefill block that
# holds the same positions, never from the prefill node's null block.
@pytest.mark.parametrize(
    "kv_connector", ["NixlConnector", "NixlPushConnector", "MooncakeConnector"]
)
@pytest.mark.parametrize("num_prompt_tokens", [46, 47, 48, 49])
def test_pd_decode_node_reads_prefilled_kv_in_every_window_position(
    kv_connector, num_prompt_tokens
):
    prefill = _make_scheduler(
        num_prompt_tokens, kv_connector=kv_connector, kv_role="kv_producer"
    )
    sent = _prefill_and_hand_off(prefill, kv_connector, num_prompt_tokens)

    decode = _make_scheduler(
        num_prompt_tokens, kv_connector=kv_connector, kv_role="kv_consumer"
    )
    pulled = _pull_then_compute_first_token(decode, kv_connector, sent)

    for group_id, spec in enumerate(_group_specs(decode)):
        _assert_reads_are_prefilled(spec, group_id, sent, pulled)


def _prefill_and_hand_off(scheduler, kv_connector, num_prompt_tokens):
    """Runs the prefill node's request to its hand-off: what the decode node
    is sent, with the positions each handed-off block holds."""
    request = create_request(
        request_id=1,
        num_tokens=num_prompt_tokens,
        block_size=BLOCK_SIZE,
        do_remote_decode=True,
    )
    if kv_connector == "MooncakeConnector":
        request.kv_transfer_params["transfer_id"] = "xfer-1"
    prompt = list(request.prompt_token_ids)  # the prefill node may shorten it
    scheduler.add_request(request)
    output = scheduler.schedule()
    # Every block of the prefill, by table index (index i holds positions
    # i * BLOCK_SIZE ...), before any is released.
    table = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    outputs = scheduler.update_from_output(
        output, create_model_runner_output([request])
    )
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    params = outputs[0].outputs[0].kv_transfer_params
    if kv_connector == "MooncakeConnector":
        # Mooncake hands the blocks to its sender in the next step's metadata.
        meta = scheduler.schedule().kv_connector_metadata
        handed_off = meta.reqs_to_send[request.request_id][1]
        params = dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            transfer_id="xfer-1",
            remote_engine_id="my-engine-id",
            remote_bootstrap_addr=54321,
        )
    else:
        handed_off = params["remote_block_ids"]
    null_block_id = scheduler.kv_cache_manager.block_pool.null_block.block_id
    return SimpleNamespace(
        params=params,
        prompt=prompt,
        num_prompt_tokens=num_prompt_tokens,
        num_computed_tokens=request.num_computed_tokens,
        blocks=[list(group) for group in handed_off],
        index={block: i for group in table for i, block in enumerate(group)},
        null_block_id=null_block_id,
    )


def _pull_then_compute_first_token(scheduler, kv_connector, sent):
    """The decode node's request up to its first computed token: the blocks
    it pulled into, and its block table then."""
    request = create_request(
        request_id=1,
        num_tokens=sent.num_prompt_tokens,
        block_size=BLOCK_SIZE,
        do_remote_prefill=True,
    )
    assert request.prompt_token_ids == sent.prompt
    request.kv_transfer_params = dict(sent.params)
    scheduler.add_request(request)
    output = scheduler.schedule()
    meta = output.kv_connector_metadata
    if kv_connector == "MooncakeConnector":
        pull = meta.reqs_to_recv["my-engine-id"][request.request_id]
    else:
        pull = meta.reqs_to_recv[request.request_id]
    num_loaded = request.num_computed_tokens
    scheduler.update_from_output(
        output,
        create_model_runner_output([], finished_recving={request.request_id}),
    )
    output = scheduler.schedule()
    num_scheduled = output.num_scheduled_tokens.get(request.request_id, 0)
    assert num_scheduled, "the decode node did not compute after its load finished"
    return SimpleNamespace(
        blocks=[list(group) for group in pull.local_block_ids],
        table=scheduler.kv_cache_manager.get_block_ids(request.request_id),
        num_loaded=num_loaded,
        # num_computed_tokens counts the scheduled tokens already
        first_computed=request.num_computed_tokens - num_scheduled,
        null_block_id=scheduler.kv_cache_manager.block_pool.null_block.block_id,
    )


def _group_specs(scheduler):
    return [g.kv_cache_spec for g in scheduler.kv_cache_config.kv_cache_groups]


def _pair_from_the_tail(pulled: list[int], handed_off: list[int]) -> dict[int, int]:
    """decode block -> prefill block, as the connectors' workers pair them."""
    assert len(pulled) <= len(handed_off), (
        f"the decode node pulls {len(pulled)} blocks, the prefill node hands "
        f"over {len(handed_off)}: the connector fails the transfer"
    )
    return dict(zip(pulled, handed_off[len(handed_off) - len(pulled) :]))


def _assert_reads_are_prefilled(spec, group_id, sent, pulled):
    position = pulled.first_computed  # the decode node's first computed token
    window = getattr(spec, "sliding_window", None) or position + 1
    pairs = _pair_from_the_tail(pulled.blocks[group_id], sent.blocks[group_id])
    for read in range(max(0, position - window + 1), min(position, pulled.num_loaded)):
        index = read // BLOCK_SIZE
        block = pulled.table[group_id][index]
        where = (
            f"{type(spec).__name__} group: the token at position {position} reads "
            f"position {read}, block index {index} of the decode table "
            f"{pulled.table[group_id]} (pulled {pulled.blocks[group_id]} from "
            f"{sent.blocks[group_id]})"
        )
        assert block != pulled.null_block_id, f"{where}: it is the null block"
        source = pairs.get(block)
        assert source is not None, f"{where}: it was not pulled"
        assert source != sent.null_block_id, (
            f"{where}: it is filled from the prefill node's null block"
        )
        assert sent.index[source] == index, (
            f"{where}: it is filled from prefill block {source}, which holds "
            f"block index {sent.index[source]}: positions off by "
            f"{(sent.index[source] - index) * BLOCK_SIZE}"
        )
        assert read < sent.num_computed_tokens, (
            f"{where}: the prefill node computed {sent.num_computed_tokens} tokens"
        )


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
