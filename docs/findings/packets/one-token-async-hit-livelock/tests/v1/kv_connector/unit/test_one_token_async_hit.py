# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Once an async KV load has finished, the scheduler does not ask the connector
about that request again: it tells a request whose load is done from a new one
by a nonzero num_computed_tokens. A load that covers the whole prompt is cut back by one
token, so that the last token is computed and sampled from; for a one-token
prompt that leaves num_computed_tokens at 0, and the request looks new again.
A connector that still holds the token (as a store does: it reports what it
holds at the time of the call) is asked again, offers the same async load, and
the request never runs.
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
MAX_STEPS = 10


def test_one_token_prompt_runs_after_its_async_load():
    scheduler = create_scheduler(create_vllm_config(block_size=BLOCK_SIZE))
    request = create_request(
        request_id=1, num_tokens=1, max_tokens=2, block_size=BLOCK_SIZE
    )
    scheduler.add_request(request)

    # A store that holds the prompt's one token and offers it, asynchronously,
    # whenever it is asked for the tokens past `num_computed_tokens`.
    scheduler.connector = create_mock_connector()
    scheduler.connector.get_loaded_kv_cache_group_ids.return_value = (0,)
    scheduler.connector.get_num_new_matched_tokens.side_effect = (
        lambda req, num_computed_tokens: (
            (1, True) if num_computed_tokens == 0 else (0, False)
        )
    )
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()

    num_loads = 0
    for _ in range(MAX_STEPS):
        output = scheduler.schedule()
        if request.request_id in output.num_scheduled_tokens:
            break
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        num_loads += 1
        # The load started in this step finishes by the next one.
        scheduler.update_from_output(
            output,
            create_model_runner_output([], finished_recving={request.request_id}),
        )

    num_queries = scheduler.connector.get_num_new_matched_tokens.call_count
    assert request.request_id in output.num_scheduled_tokens, (
        f"a one-token prompt whose async load of its whole prompt finished was "
        f"not scheduled in {MAX_STEPS} steps: the scheduler asked the connector "
        f"again after each load ({num_queries} queries) and started {num_loads} "
        f"loads of the same token"
    )
    assert num_loads == 1
