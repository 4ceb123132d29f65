# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An async KV load that fails before its first valid block, under
kv_load_failure_policy="recompute", gives all of its request's blocks back
(``Scheduler._update_waiting_for_remote_kv``). The request must then be
admitted like a fresh one: its retry must not be held back by the in-flight
reservation (``Scheduler._inflight_prefill_reserved_blocks``) of its own
failed load, and, holding no blocks, it must not stay ahead of requests that
do hold KV and whose loads have finished.
"""

import pytest

from vllm.v1.request import RequestStatus

from .utils import (
    create_mock_connector,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
# A bound on the scheduler steps the loads need once no load fails.
MAX_STEPS = 10


def _make_scheduler(max_model_len: int, num_blocks: int, **kwargs):
    vllm_config = create_vllm_config(
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        kv_load_failure_policy="recompute",
        **kwargs,
    )
    # The limit the scheduler enforces (create_vllm_config's max_model_len only
    # reaches the scheduler config's checks).
    vllm_config.model_config.max_model_len = max_model_len
    scheduler = create_scheduler(vllm_config, num_blocks=num_blocks)
    # A store that holds HITS[request_id] prompt tokens, loaded asynchronously,
    # and offers them again on every lookup (a failed load included).
    hits: dict[str, int] = {}
    scheduler.connector = create_mock_connector()
    scheduler.connector.get_loaded_kv_cache_group_ids.return_value = (0,)
    scheduler.connector.get_num_new_matched_tokens.side_effect = (
        lambda request, num_computed_tokens: (
            hits.get(request.request_id, 0),
            hits.get(request.request_id, 0) > 0,
        )
    )
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    return scheduler, hits


def _fail_load(scheduler, scheduler_output, request, also_finished=()):
    """The worker reports `request`'s load finished with its first block invalid."""
    (block_ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    scheduler.update_from_output(
        scheduler_output,
        create_model_runner_output(
            [],
            finished_recving={request.request_id, *also_finished},
            invalid_block_ids={block_ids[0]},
        ),
    )
    assert request.num_computed_tokens == 0


def _run_until_scheduled(scheduler, requests) -> set[str]:
    """Step with no failures (each load started finishes at the next step)
    until every request in `requests` is scheduled; return those that were."""
    scheduled: set[str] = set()
    for _ in range(MAX_STEPS):
        output = scheduler.schedule()
        scheduled |= set(output.num_scheduled_tokens)
        if scheduled >= {r.request_id for r in requests}:
            break
        loading = {
            r.request_id
            for r in requests
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        running = [r for r in requests if r.request_id in output.num_scheduled_tokens]
        scheduler.update_from_output(
            output, create_model_runner_output(running, finished_recving=loading)
        )
    return scheduled


def _state(scheduler, request) -> str:
    return (
        f"{request.request_id}: {request.status.name}, "
        f"{request.num_computed_tokens} computed, "
        f"in _inflight_prefills: {request in scheduler._inflight_prefills}"
    )


def test_failed_async_load_retry_is_not_held_back_by_its_own_reservation():
    # The pool holds exactly one max_model_len sequence (plus the null block),
    # the smallest pool vLLM starts with.
    max_model_len = 10 * BLOCK_SIZE
    scheduler, hits = _make_scheduler(max_model_len, num_blocks=10 + 1)
    num_free_blocks = scheduler.kv_cache_manager.block_pool.get_num_free_blocks

    request = create_request(
        request_id=1, num_tokens=max_model_len - 10, block_size=BLOCK_SIZE
    )
    hits[request.request_id] = 2 * BLOCK_SIZE
    scheduler.add_request(request)

    output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # The load fails at its first block: nothing valid is left to keep.
    _fail_load(scheduler, output, request)

    scheduled = _run_until_scheduled(scheduler, [request])
    assert request.request_id in scheduled, (
        f"the request was not scheduled within {MAX_STEPS} steps after its "
        f"failed load, with {num_free_blocks()} of 10 blocks free: its retry is "
        f"held back by the reservation of its own failed load "
        f"({scheduler._inflight_prefill_reserved_blocks()} blocks); "
        f"{_state(scheduler, request)}"
    )
    assert request.status == RequestStatus.RUNNING


def test_failed_async_load_retry_does_not_block_a_finished_load():
    # The stall needs no spec decode: as released, `failing`'s reservation of
    # its own blocks plus `finishing`'s keeps the retry out. Spec decode is on
    # so that the test checks the second change of the fix: its step blocks
    # keep the retry out even once `failing` no longer reserves for itself, so
    # taking `failing` out of _inflight_prefills alone does not pass.
    scheduler, hits = _make_scheduler(
        max_model_len=10 * BLOCK_SIZE, num_blocks=10 + 1, num_speculative_tokens=2
    )

    # `failing` needs 2 blocks, `finishing` 9: both loads fit together.
    failing = create_request(
        request_id=1, num_tokens=2 * BLOCK_SIZE, block_size=BLOCK_SIZE
    )
    finishing = create_request(
        request_id=2, num_tokens=9 * BLOCK_SIZE, block_size=BLOCK_SIZE
    )
    hits[failing.request_id] = BLOCK_SIZE
    hits[finishing.request_id] = BLOCK_SIZE
    scheduler.add_request(failing)
    scheduler.add_request(finishing)

    output = scheduler.schedule()
    assert failing.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert finishing.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # In the same step, `failing`'s load fails at its first block and
    # `finishing`'s load succeeds.
    _fail_load(scheduler, output, failing, also_finished={finishing.request_id})

    # `failing`'s retry does not fit beside `finishing`'s reservation, but it
    # holds no blocks now: `finishing`, whose KV has arrived, must still run.
    scheduled = _run_until_scheduled(scheduler, [finishing])
    assert finishing.request_id in scheduled, (
        f"a request whose load has finished was not scheduled within "
        f"{MAX_STEPS} steps: it waits behind a request that gave its blocks "
        f"back when its own load failed; {_state(scheduler, finishing)}; "
        f"{_state(scheduler, failing)}"
    )
