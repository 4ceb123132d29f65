"""vLLM v1 scheduler, hybrid KV cache (full attention + sliding window): an async external
hit of the whole prompt leaves the window of the recomputed last token on the null block.

r (5 prompt tokens, block size 2, window 2) gets an async hit on all 5 tokens. The first
``schedule()`` allocates for 5 computed tokens and pads the sliding-window blocks a step
from position 5 would not read (positions 0 to 3, blocks 0 and 1) with the null block.
When the load finishes, ``_update_waiting_for_remote_kv`` lowers ``num_computed_tokens`` to
4 so the last prompt token is computed again. That step reads positions 3 and 4, and
position 3 lies in block 1, which is still the null block. With 4 prompt tokens (the
contrast case) the resumed token's window starts at a block boundary and nothing is lost.
"""
# kvspec fix: kvspec/harness/patches/fixes/hybrid-full-prompt-hit-keeps-window.diff

import json

import pytest
import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                SupportsHMA)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 2
WINDOW = 2
HASH_FN = get_hash_fn_by_name("sha256")


class ScriptedConnector(KVConnectorBase_V1, SupportsHMA):
    """Scheduler-side HMA connector: the external store holds HITS[req_id] prompt tokens,
    always loaded asynchronously."""

    HITS: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = max(0, self.HITS.get(request.request_id, 0) - num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


def make_scheduler(tmp_path, num_blocks=16):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 4096}))
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                 max_model_len=12, dtype="float32"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=4, max_model_len=12,
            is_encoder_decoder=False, enable_chunked_prefill=True, async_scheduling=False,
            disable_hybrid_kv_cache_manager=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ScriptedConnector", kv_connector_module_path=__name__,
            kv_role="kv_both", kv_load_failure_policy="recompute"),
        device_config=DeviceConfig("cpu"))
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = dict(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["full.0"], FullAttentionSpec(**spec)),
        KVCacheGroupSpec(["swa.0"], SlidingWindowSpec(**spec, sliding_window=WINDOW))])
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=BLOCK_SIZE, log_stats=True)


def runner_output(scheduler_output, finished_recving=()):
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[5] for _ in req_ids],
        kv_connector_output=KVConnectorOutput(finished_recving=set(finished_recving) or None))


# 5: (n - WINDOW + 1) is a multiple of BLOCK_SIZE, the window loses a block; 4: contrast
@pytest.mark.parametrize("prompt_len", [4, 5])
def test_full_prompt_async_hit_keeps_the_recomputed_tokens_window(tmp_path, prompt_len):
    scheduler = make_scheduler(tmp_path)
    assert len(scheduler.kv_cache_config.kv_cache_groups) == 2
    null_block_id = scheduler.kv_cache_manager.block_pool.null_block.block_id
    prompt = [1, 2, 3, 4, 24][:prompt_len]
    ScriptedConnector.HITS = {"r": prompt_len}  # an async hit on the whole prompt
    init_none_hash(HASH_FN)
    r = Request("r", prompt, SamplingParams(max_tokens=2), None,
                block_hasher=get_request_block_hasher(BLOCK_SIZE, HASH_FN))
    scheduler.add_request(r)

    out = scheduler.schedule()  # the load is issued
    assert out.num_scheduled_tokens == {} and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(out, runner_output(out, finished_recving={"r"}))

    out = scheduler.schedule()  # the load finished: r recomputes its last prompt token
    assert out.num_scheduled_tokens == {"r": 1} and r.status == RequestStatus.RUNNING
    resumed = r.num_computed_tokens - 1  # schedule() counted the scheduled token already
    assert resumed == prompt_len - 1

    full_blocks, window_blocks = scheduler.kv_cache_manager.get_block_ids("r")
    assert null_block_id not in full_blocks, full_blocks
    # the step from `resumed` computes the token at that position: its window starts at
    # resumed - WINDOW + 1, and every block of the window must be a real block
    first_read = max(0, resumed - WINDOW + 1)
    read = range(first_read // BLOCK_SIZE, resumed // BLOCK_SIZE + 1)
    nulls = [i for i in read if window_blocks[i] == null_block_id]
    assert not nulls, (
        f"the step from {resumed} computed tokens reads positions {first_read}..{resumed} "
        f"in the sliding-window group, but its block(s) {nulls} are the null block "
        f"{null_block_id}: table {window_blocks}")
