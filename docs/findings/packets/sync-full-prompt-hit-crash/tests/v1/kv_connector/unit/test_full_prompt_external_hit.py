# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A connector hit that covers the whole prompt must leave the scheduler a token
to compute, whether the connector loads it synchronously or asynchronously.

The asynchronous path recomputes the last prompt token once the load is done
(``Scheduler._update_waiting_for_remote_kv``); the synchronous path adds the
hit to the computed count as it is, so ``schedule()`` is left with nothing to
run and fails ``assert num_new_tokens > 0``.
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


def _schedule(scheduler, what: str):
    """Run one schedule() and turn a crash inside it into a test failure that
    names the step and the assert that fired."""
    try:
        return scheduler.schedule()
    except AssertionError as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        crash = f"{frame.name}: `{frame.line}`"
    pytest.fail(f"schedule() raised AssertionError in {crash} while {what}")


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_full_prompt_external_hit_schedules_last_token(load_async: bool):
    scheduler = create_scheduler(
        create_vllm_config(block_size=BLOCK_SIZE),
        num_blocks=64,
    )
    # Two full blocks: the store holds every prompt token.
    num_tokens = 2 * BLOCK_SIZE
    request = create_request(
        request_id=1, num_tokens=num_tokens, block_size=BLOCK_SIZE
    )
    scheduler.add_request(request)

    scheduler.connector = create_mock_connector()
    scheduler.connector.get_loaded_kv_cache_group_ids.return_value = (0,)
    scheduler.connector.get_num_new_matched_tokens.side_effect = [
        (num_tokens, load_async),
        (0, False),
    ]
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()

    output = _schedule(
        scheduler,
        f"admitting a request whose {num_tokens} prompt tokens the connector "
        f"all offers ({'async' if load_async else 'sync'})",
    )
    if load_async:
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        scheduler.update_from_output(
            output,
            create_model_runner_output([], finished_recving={request.request_id}),
        )
        output = _schedule(scheduler, "resuming the request after its load")

    # The request runs in this step, and what it runs reaches the end of the
    # prompt: either the hit is cut back to leave the last token (what the
    # asynchronous path does) or it is refused and the prompt is computed.
    # (schedule() has already advanced num_computed_tokens by the step.)
    assert request.status == RequestStatus.RUNNING
    assert output.num_scheduled_tokens.get(request.request_id, 0) >= 1
    assert request.num_computed_tokens == num_tokens
