# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A request preempted outside schedule() (a forced reset_prefix_cache) is
listed in the next SchedulerOutput's preempted_req_ids and may be resumed in
that same output. MooncakeStoreConnector's build_connector_meta must not lose
the state update_state_after_alloc just recorded for it."""

from unittest.mock import MagicMock, patch

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
)
from vllm.v1.request import RequestStatus

from .utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test

LOOKUP_CLIENT = (
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler."
    "LookupKeyClient"
)


def _empty_store_client(*args, **kwargs):
    client = MagicMock()
    client.lookup.return_value = MooncakeLookupResult(0)
    client.reset.return_value = True
    return client


def test_forced_reset_then_resume_in_the_next_output():
    with patch(LOOKUP_CLIENT, _empty_store_client):
        scheduler = create_scheduler(
            create_vllm_config(kv_connector="MooncakeStoreConnector", kv_role="kv_both")
        )
    # Shorter than a block: no save job pins its blocks, so the reset may
    # preempt it.
    request = create_request(num_tokens=10, max_tokens=4)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, create_model_runner_output([request]))
    assert request.status == RequestStatus.RUNNING

    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert request.status == RequestStatus.PREEMPTED

    output = scheduler.schedule()  # TypeError in build_connector_meta as released
    assert request.request_id in output.preempted_req_ids
    assert request.request_id in output.scheduled_cached_reqs.resumed_req_ids
