# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A request aborted while its async KV load is in flight, whose connector also
answers request_finished() with "delay the free" (a send or save), has two
transfers holding its blocks: the load still writing them and the send reading
them. The scheduler must keep the blocks, and the request, until both are
reported, in whichever order the worker reports them.

As released, the first report frees the blocks and forgets the request: a
load reported first leaves the send reading freed blocks, a send reported
first leaves the load writing into them, and the second report fails
``assert req_id in self.requests`` in ``_update_from_kv_xfer_finished``.
"""

import traceback

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

ORDERS = {
    "recv_then_send": [{"finished_recving"}, {"finished_sending"}],
    "send_then_recv": [{"finished_sending"}, {"finished_recving"}],
    "same_step": [{"finished_recving", "finished_sending"}],
}


def _report(scheduler, req_id: str, kinds: set[str]) -> None:
    """One engine step whose worker output reports `kinds` for `req_id`; a
    crash in update_from_output fails the test with the assert that fired."""
    output = scheduler.schedule()
    runner_output = create_model_runner_output(
        [], **{kind: {req_id} for kind in kinds}
    )
    try:
        scheduler.update_from_output(output, runner_output)
        return
    except AssertionError as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        crash = f"{frame.name}: `{frame.line}`"
    pytest.fail(
        f"update_from_output raised AssertionError in {crash} on a report of "
        f"{sorted(kinds)} for an aborted request"
    )


@pytest.mark.parametrize("order", list(ORDERS))
def test_abort_mid_load_waits_for_load_and_send(order: str):
    scheduler = create_scheduler(
        create_vllm_config(block_size=BLOCK_SIZE), num_blocks=64
    )
    request = create_request(
        request_id=1, num_tokens=3 * BLOCK_SIZE, block_size=BLOCK_SIZE
    )
    req_id = request.request_id
    scheduler.add_request(request)

    scheduler.connector = create_mock_connector()
    scheduler.connector.get_loaded_kv_cache_group_ids.return_value = (0,)
    # Two blocks of the prompt are loaded asynchronously.
    scheduler.connector.get_num_new_matched_tokens.side_effect = [
        (2 * BLOCK_SIZE, True),
    ]
    # When the request finishes, the connector keeps its blocks for a send.
    scheduler.connector.request_finished.return_value = (True, None)
    scheduler.connector.take_events.return_value = ()

    block_pool = scheduler.kv_cache_manager.block_pool
    scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # Scheduler.deferred_loads is new in 0.33.0 (0.32.0 has no such attribute)
    assert req_id not in getattr(scheduler, "deferred_loads", {})
    (block_ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
    assert block_ids

    # Abort while the load is in flight: both the load and the send hold the
    # blocks now.
    scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
    assert scheduler.connector.request_finished.call_count == 1

    *first_reports, last_report = ORDERS[order]
    for kinds in first_reports:
        _report(scheduler, req_id, kinds)
        # One transfer is still running: its blocks must stay allocated, and
        # the request known, until it is reported too.
        freed = [b for b in block_ids if block_pool.blocks[b].ref_cnt == 0]
        assert not freed, (
            f"blocks {freed} went back to the pool after {sorted(kinds)} alone, "
            f"while the other transfer still uses them"
        )
        assert req_id in scheduler.requests, (
            f"the request was forgotten after {sorted(kinds)} alone"
        )

    _report(scheduler, req_id, last_report)
    # Both transfers are done: the request is gone and its blocks are free.
    assert req_id not in scheduler.requests
    assert all(block_pool.blocks[b].ref_cnt == 0 for b in block_ids)
