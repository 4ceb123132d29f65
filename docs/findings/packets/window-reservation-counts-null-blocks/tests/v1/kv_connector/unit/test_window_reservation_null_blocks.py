# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The blocks an in-flight prefill still needs (its reservation against later
async loads, ``Scheduler._request_remaining_blocks``) must not be undercounted
for a sliding-window group whose block table starts with null blocks.

The admission cap of a sliding-window group
(``SlidingWindowSpec.max_admission_blocks_per_request``) bounds the real blocks
a request holds at once; the null entries that stand for positions already out
of the window hold none. Once a request's table, null entries included, is
as long as the cap, the cap less the table's length leaves nothing to reserve
for that group, although the request's next token may still need a new block
in it.

The mock connector's async load stops one token short of the prompt's end,
as the P/D connectors' decode side does for a model with Mamba layers (NIXL's
``_prefill_backoff``, Mooncake's ``_get_remote_prefill_token_count``). The
long prompt below is one token longer than a whole number of blocks, so its
load ends on a block boundary and its last token needs a new block in every
group. No Mamba group is needed to show the undercount; the NIXL case of the
first test has one, because that is when NIXL stops short by itself.
"""

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
# With create_vllm_config's defaults (max_num_batched_tokens 64, synchronous
# scheduling) the window group's admission cap is
# cdiv(SLIDING_WINDOW - 1 + 64, BLOCK_SIZE) + 1 = 7 blocks.
ADMISSION_CAP = 7
# A prompt whose load fills 8 table entries (6 of them null once loaded),
# more than the cap, and leaves one token that starts a new block.
LONG_PROMPT = 8 * BLOCK_SIZE + 1
# A prompt within one block: its load takes every block it will ever need.
SHORT_PROMPT = BLOCK_SIZE // 2
# A bound on the steps both requests need once their loads have landed.
MAX_STEPS = 10


class AllButLastTokenConnector(MockKVConnector, SupportsHMA):
    """Offers every prompt token but the last one, loaded asynchronously."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return request.num_prompt_tokens - 1 - num_computed_tokens, True

    def request_finished_all_groups(self, request, block_ids):
        return False, None


def _make_scheduler(num_blocks: int, kv_connector: str = "AllButLastTokenConnector"):
    mock = kv_connector == "AllButLastTokenConnector"
    vllm_config = create_vllm_config(
        block_size=BLOCK_SIZE,
        kv_connector=kv_connector,
        kv_connector_module_path=__name__ if mock else None,
        kv_role="kv_consumer",
        # Read by MockKVConnector's constructor; the subclass ignores them.
        kv_connector_extra_config={"matched_tokens": 0, "is_async": True}
        if mock
        else None,
        disable_hybrid_kv_cache_manager=False,
    )
    kv_cache_config = make_kv_cache_config(
        block_size=BLOCK_SIZE,
        swa_enabled=True,
        sw_size=SLIDING_WINDOW,
        # NIXL's decode side backs off one token only for Mamba (or bounded
        # replay) models.
        mamba_enabled=not mock,
        mamba_cache_mode="align",
        num_blocks=num_blocks,
    )
    scheduler = create_scheduler(vllm_config, kv_cache_config=kv_cache_config)
    window_manager = scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    assert window_manager.max_admission_blocks_per_request == ADMISSION_CAP
    return scheduler


def _step(scheduler, requests, landed: set[str]):
    """One scheduler step; every load issued so far lands with its output
    (reported once per request)."""
    output = scheduler.schedule()
    loading = {
        r.request_id
        for r in requests
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        and r.request_id not in landed
    }
    landed |= loading
    running = [r for r in requests if r.request_id in output.num_scheduled_tokens]
    scheduler.update_from_output(
        output, create_model_runner_output(running, finished_recving=loading)
    )
    return output


def _table(scheduler, request) -> str:
    null_block_id = scheduler.kv_cache_manager.block_pool.null_block.block_id
    full, window, *_ = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    num_null = sum(b == null_block_id for b in window)
    return (
        f"{len(full)} full-attention blocks, {len(window)} window entries "
        f"({num_null} null)"
    )


@pytest.mark.parametrize("kv_connector", ["AllButLastTokenConnector", "NixlConnector"])
def test_remaining_blocks_cover_next_step_after_load(kv_connector):
    """The reservation of a loaded request is at least what its next step
    takes. Also with NIXL's decode side on a model with a Mamba group, whose
    load stops one token short for the Mamba state's sake."""
    scheduler = _make_scheduler(num_blocks=100, kv_connector=kv_connector)
    free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks
    request = create_request(
        request_id=1,
        num_tokens=LONG_PROMPT,
        max_tokens=1,
        block_size=BLOCK_SIZE,
        do_remote_prefill=kv_connector == "NixlConnector",
    )
    scheduler.add_request(request)

    _step(scheduler, [request], set())  # the load is issued and lands
    assert request.num_computed_tokens == LONG_PROMPT - 1
    table = _table(scheduler, request)
    reserved = scheduler._request_remaining_blocks(request)

    num_free = free_blocks()
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {request.request_id: 1}
    taken = num_free - free_blocks()
    # The last prompt token takes a new block in every group.
    assert taken == len(scheduler.kv_cache_config.kv_cache_groups)
    assert reserved >= taken, (
        f"the loaded request's remaining blocks count {reserved}, but its "
        f"next step takes {taken} (one per group); its table held {table}: "
        f"the window group's need is the cap ({ADMISSION_CAP}) less the "
        f"table's length, null entries included"
    )


def test_loads_admitted_behind_undercounted_reservation_do_not_stall():
    """Nothing runs, so no block is ever freed: the request at the head of the
    loaded requests cannot take the blocks it needs, and the request behind
    it, whose load was admitted into those blocks, waits behind it forever."""
    # The long request's load holds 8 + 2 blocks, the short one's 1 + 1; the
    # long request's last token needs 2 more. 13 blocks (and the null block)
    # leave 3 after the long load: room for the short load beside the long
    # request's reservation only if that is counted as 1 block, not 2. Counted
    # as 2, the short load waits until the long request has run.
    scheduler = _make_scheduler(num_blocks=13 + 1)
    long = create_request(
        request_id=1, num_tokens=LONG_PROMPT, max_tokens=1, block_size=BLOCK_SIZE
    )
    short = create_request(
        request_id=2, num_tokens=SHORT_PROMPT, max_tokens=1, block_size=BLOCK_SIZE
    )
    requests = [long, short]
    for request in requests:
        scheduler.add_request(request)

    ran: set[str] = set()
    landed: set[str] = set()
    for _ in range(MAX_STEPS):
        output = _step(scheduler, requests, landed)
        ran |= set(output.num_scheduled_tokens)
        if all(r.is_finished() for r in requests):
            break

    num_free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert all(r.is_finished() for r in requests), (
        f"after {MAX_STEPS} steps, requests run: {sorted(ran) or 'none'}, with "
        f"{num_free} blocks free and every load landed: the head of the loaded "
        f"requests cannot allocate its next token and nothing frees a block; "
        + "; ".join(
            f"{r.request_id}: {r.status.name}, {r.num_computed_tokens}/"
            f"{r.num_tokens} computed, {_table(scheduler, r)}, reserving "
            f"{scheduler._request_remaining_blocks(r)}"
            for r in requests
        )
    )
