# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""With several KV cache groups a connector cannot report a failed synchronous
load: block ids are refused for such layouts, and a request-level report
(``failed_recving``) is only acted on while the request waits for an
asynchronous load. A synchronously loaded request is already running."""

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
NUM_PROMPT_TOKENS = 5 * BLOCK_SIZE
NUM_EXTERNAL_TOKENS = 3 * BLOCK_SIZE


class HMAMockKVConnector(MockKVConnector, SupportsHMA):
    """MockKVConnector that also takes the block ids of every KV cache group."""

    def request_finished_all_groups(self, request, block_ids):
        return False, None


def _create_request():
    # Every request gets the same prompt.
    return create_request(
        num_tokens=NUM_PROMPT_TOKENS,
        common_prefix_len=NUM_PROMPT_TOKENS,
        block_size=BLOCK_SIZE,
    )


def _schedule_sync_load(policy: str):
    """Schedule a request whose first 48 tokens are loaded synchronously."""
    vllm_config = create_vllm_config(
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=64,
        kv_connector="HMAMockKVConnector",
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        kv_connector_extra_config={
            "matched_tokens": NUM_EXTERNAL_TOKENS,
            "is_async": False,
        },
        kv_load_failure_policy=policy,
        disable_hybrid_kv_cache_manager=False,
    )
    kv_cache_config = make_kv_cache_config(
        block_size=BLOCK_SIZE, swa_enabled=True, sw_size=2 * BLOCK_SIZE, num_blocks=64
    )
    scheduler = create_scheduler(vllm_config, kv_cache_config=kv_cache_config)
    request = _create_request()
    scheduler.add_request(request)

    output = scheduler.schedule()
    # The load and the rest of the prompt run in the same step.
    assert output.num_scheduled_tokens == {
        request.request_id: NUM_PROMPT_TOKENS - NUM_EXTERNAL_TOKENS
    }
    assert request.status == RequestStatus.RUNNING
    return scheduler, request, output


def _run_failed_sync_load(policy: str):
    """The same, with the load reported failed by the request-level report
    (``failed_recving``), which 0.33.0's error for block ids points to. A
    remedy may act on it or accept block ids for several groups; the tests
    below send only this report, so they judge either."""
    scheduler, request, output = _schedule_sync_load(policy)
    model_runner_output = create_model_runner_output([request], finished_recving=set())
    model_runner_output.kv_connector_output.failed_recving = {request.request_id}
    engine_outputs = scheduler.update_from_output(output, model_runner_output)
    emitted = [
        out.new_token_ids
        for eco in engine_outputs.values()
        for out in eco.outputs
        if out.request_id == request.request_id and out.new_token_ids
    ]
    return scheduler, request, emitted


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_block_ids_are_refused_with_several_groups(policy):
    """Documents 0.33.0: block ids are refused on a layout with several KV cache
    groups, with an error that names ``failed_recving``. A remedy that makes
    block ids work for several groups changes this test on purpose."""
    scheduler, request, output = _schedule_sync_load(policy)
    full_attention_blocks, _ = scheduler.kv_cache_manager.get_block_ids(
        request.request_id
    )
    with pytest.raises(RuntimeError, match="failed_recving"):
        scheduler.update_from_output(
            output,
            create_model_runner_output(
                [request], invalid_block_ids={full_attention_blocks[0]}
            ),
        )


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_sync_load_is_acted_on(policy):
    _, request, emitted = _run_failed_sync_load(policy)

    assert not emitted, (
        f"a token sampled from the failed load was returned: {emitted}; the "
        f"request is {request.status.name} with {request.num_computed_tokens} "
        f"computed tokens"
    )
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR, request.status
    else:
        assert request.num_computed_tokens < NUM_EXTERNAL_TOKENS, (
            f"the request still counts {request.num_computed_tokens} computed "
            f"tokens, the {NUM_EXTERNAL_TOKENS} that failed to load among them"
        )


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_sync_load_is_not_served_from_prefix_cache(policy):
    scheduler, _, _ = _run_failed_sync_load(policy)

    _, num_cached_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(
        _create_request()
    )
    assert num_cached_tokens == 0, (
        f"a later request with the same prompt gets a {num_cached_tokens}-token "
        f"prefix cache hit: its first {NUM_EXTERNAL_TOKENS} tokens failed to load "
        f"and the rest were computed over them"
    )
