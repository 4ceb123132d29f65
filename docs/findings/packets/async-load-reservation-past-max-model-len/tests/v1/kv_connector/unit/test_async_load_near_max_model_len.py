# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""With spec decode, admitting an async KV load holds back the blocks of the
request's own first spec decode step, in every KV cache group, on top of the
blocks the load fills. A request never grows past max_model_len, so in a group
where it already reaches its last block below max_model_len, that step needs no
new block. Holding one back anyway keeps a remote prefill near max_model_len
out of a pool sized for max_model_len forever, and the waiting requests behind
it with it.
"""

import pytest

from vllm.v1.request import RequestStatus

from .utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024  # 64 blocks
NUM_SPEC_TOKENS = 4  # a spec decode step of 5 tokens: one block per group
MAX_STEPS = 10


@pytest.mark.parametrize("num_groups", [1, 2], ids=["one-group", "two-groups"])
def test_remote_prefill_near_max_model_len_is_admitted(num_groups: int):
    # A decode instance (NixlConnector, kv_consumer) with spec decode.
    vllm_config = create_vllm_config(
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        num_speculative_tokens=NUM_SPEC_TOKENS,
        disable_hybrid_kv_cache_manager=num_groups == 1,
    )
    # The limit the scheduler enforces (create_vllm_config's max_model_len only
    # reaches the scheduler config's checks).
    vllm_config.model_config.max_model_len = MAX_MODEL_LEN
    # The pool holds one max_model_len sequence in every group (plus the null
    # block): the smallest pool vLLM starts with. The second group is a sliding
    # window wider than max_model_len: it needs a block per BLOCK_SIZE tokens.
    usable_blocks = num_groups * MAX_MODEL_LEN // BLOCK_SIZE
    kv_cache_config = make_kv_cache_config(
        BLOCK_SIZE,
        swa_enabled=num_groups == 2,
        sw_size=4 * MAX_MODEL_LEN,
        num_blocks=usable_blocks + 1,
    )
    scheduler = create_scheduler(
        vllm_config, num_blocks=usable_blocks + 1, kv_cache_config=kv_cache_config
    )

    # 1010 tokens fill 64 blocks per group; the first decode step (the last
    # prompt token and 4 drafts) stays inside the 64th block. NixlConnector
    # offers the whole prompt, loaded asynchronously.
    remote_prefill = create_request(
        request_id=1,
        num_tokens=1010,
        max_tokens=1,
        block_size=BLOCK_SIZE,
        do_remote_prefill=True,
        num_remote_blocks=64,
    )
    local_prefill = create_request(
        request_id=2, num_tokens=2 * BLOCK_SIZE, max_tokens=1, block_size=BLOCK_SIZE
    )
    scheduler.add_request(remote_prefill)
    scheduler.add_request(local_prefill)

    admitted, scheduled = False, set()
    for _ in range(MAX_STEPS):
        output = scheduler.schedule()
        loading = remote_prefill.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        admitted |= loading
        scheduled |= set(output.num_scheduled_tokens)
        if local_prefill.request_id in scheduled:
            break
        running = [
            r
            for r in (remote_prefill, local_prefill)
            if r.request_id in output.num_scheduled_tokens
        ]
        # Every load that was started finishes by the next step.
        scheduler.update_from_output(
            output,
            create_model_runner_output(
                running,
                finished_recving={remote_prefill.request_id} if loading else None,
            ),
        )

    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert admitted, (
        f"the async load of a {remote_prefill.num_tokens}-token prompt "
        f"(max_model_len {MAX_MODEL_LEN}) was not admitted in {MAX_STEPS} steps "
        f"with {free} of {usable_blocks} blocks free: admission held back blocks "
        f"for its spec decode step past max_model_len, which it can never use"
    )
    assert remote_prefill.request_id in scheduled
    assert local_prefill.request_id in scheduled, (
        f"the request queued behind it was not scheduled in {MAX_STEPS} steps"
    )
