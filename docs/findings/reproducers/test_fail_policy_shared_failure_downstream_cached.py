"""vLLM v1 scheduler, kv_load_failure_policy="fail": a failed block shared in one batch
leaves the second request's downstream blocks in the prefix cache.

r1 (sync external load) and r2 (a prefix hit on r1's first block) are scheduled in one
step; the worker reports that shared block invalid. ``_update_requests_with_invalid_blocks``
collects blocks to evict from the failed block onward only for r1 (for r2 it is "already
marked"), so r2's next block, computed on top of garbage KV, stays cached for later requests.
"""
# kvspec fix: kvspec/harness/patches/fixes/recovery-cuts-every-request-at-its-first-failed-block.diff

import json

import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 2
HASH_FN = get_hash_fn_by_name("sha256")


class ScriptedConnector(KVConnectorBase_V1):
    """Scheduler-side connector: the external store holds HITS[req_id] prompt tokens."""

    HITS: dict[str, int] = {}
    ASYNC = False

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = max(0, self.HITS.get(request.request_id, 0) - num_computed_tokens)
        return n, self.ASYNC and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


def make_scheduler(tmp_path, num_blocks, max_num_batched_tokens, max_num_seqs,
                   max_model_len, policy):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 4096}))
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                 max_model_len=max_model_len, dtype="float32"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, is_encoder_decoder=False,
            enable_chunked_prefill=True, async_scheduling=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ScriptedConnector", kv_connector_module_path=__name__,
            kv_role="kv_both", kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"))
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32))])
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=BLOCK_SIZE, log_stats=True)


def make_request(req_id, prompt, max_tokens=1):
    init_none_hash(HASH_FN)
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, HASH_FN))


def runner_output(scheduler_output, invalid_block_ids=()):
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[5] for _ in req_ids],
        kv_connector_output=KVConnectorOutput(invalid_block_ids=set(invalid_block_ids)))


def test_shared_failed_block_evicts_every_downstream_block(tmp_path):
    # 7 blocks plus vLLM's null block 0; the default failure policy "fail"
    scheduler = make_scheduler(tmp_path, num_blocks=8, max_num_batched_tokens=4,
                               max_num_seqs=2, max_model_len=12, policy="fail")
    ScriptedConnector.HITS = {"r1": 8}  # a sync hit on r1's first 8 prompt tokens
    r1 = make_request("r1", [1, 2, 3, 4, 17, 18, 19, 20, 21, 22])
    r2 = make_request("r2", [1, 2, 24, 25])
    scheduler.add_request(r1)
    scheduler.add_request(r2)

    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r1": 2, "r2": 2}
    (r1_blocks,) = scheduler.kv_cache_manager.get_block_ids("r1")
    (r2_blocks,) = scheduler.kv_cache_manager.get_block_ids("r2")
    assert r2_blocks[0] == r1_blocks[0]  # r2 hit r1's (externally loaded) first block
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_cached_block(r2.block_hashes[1], [0]) is not None  # [24, 25] cached

    # The worker reports r1's first block (shared with r2) as failed to load.
    scheduler.update_from_output(out, runner_output(out, invalid_block_ids={r1_blocks[0]}))
    assert r1.status == RequestStatus.FINISHED_ERROR
    assert r2.status == RequestStatus.FINISHED_ERROR

    # r2's block [24, 25] was computed on top of the failed block: it must not stay cached.
    assert pool.get_cached_block(r2.block_hashes[0], [0]) is None, "failed block cached"
    assert pool.get_cached_block(r2.block_hashes[1], [0]) is None, (
        f"block {r2_blocks[1]} of r2, computed on top of the failed block "
        f"{r1_blocks[0]}, is still in the prefix cache")
