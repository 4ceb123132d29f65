# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A request resumed after a preemption gets a whole new block table
(``scheduled_cached_reqs.new_block_ids`` with its id in ``resumed_req_ids``).
HF3FSKVConnector's saves must name the blocks of that table, not of the one
the preemption freed."""

from unittest.mock import MagicMock, patch

import pytest

from vllm.v1.request import RequestStatus

from .utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test

HF3FS = "vllm.distributed.kv_transfer.kv_connector.v1.hf3fs.hf3fs_connector"
BLOCK_SIZE = 16


def _empty_store(*args, **kwargs):
    client = MagicMock()
    client.batch_key_exists.side_effect = lambda keys: [False] * len(keys)
    return client


def test_resumed_request_saves_from_its_new_block_table():
    # The connector's signal handlers are left out: they would replace pytest's.
    with patch(f"{HF3FS}.Hf3fsMetadataClient", _empty_store), patch(
        f"{HF3FS}.signal.signal"
    ):
        scheduler = create_scheduler(
            create_vllm_config(
                kv_connector="HF3FSKVConnector",
                kv_role="kv_both",
                block_size=BLOCK_SIZE,
            )
        )
    request = create_request(num_tokens=40, max_tokens=40, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, create_model_runner_output([request]))

    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert request.status == RequestStatus.PREEMPTED

    output = scheduler.schedule()
    assert request.request_id in output.scheduled_cached_reqs.resumed_req_ids
    checked = 0
    while True:
        checked += _check_saves(scheduler, output, request)
        scheduler.update_from_output(output, create_model_runner_output([request]))
        if request.is_finished():
            break
        output = scheduler.schedule()
    assert checked, "the resumed request saved nothing"


def _check_saves(scheduler, output, request) -> int:
    (table,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    saves = [
        r
        for r in output.kv_connector_metadata.requests
        if r.request_id == request.request_id and r.save_block_op is not None
    ]
    for save in saves:
        first = save.save_block_op.skip_leading_blocks
        last = len(save.token_ids) // BLOCK_SIZE
        named = list(save.block_ids[first:last])
        assert named == table[first:last], (
            f"the save of blocks {first}..{last - 1} names {named}, but the "
            f"resumed request's table is {table}: the blocks the preemption "
            f"freed, not its new ones"
        )
    return len(saves)
