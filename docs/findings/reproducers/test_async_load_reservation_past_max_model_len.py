"""vLLM v1 scheduler with spec decode: an async load of a prompt near max_model_len is
never admitted into a KV cache sized for max_model_len.

Admitting an async load reserves ``_spec_decode_step_blocks`` (one spec-decode step,
``1 + num_speculative_tokens`` tokens) on top of its own blocks, even for a request that can
never grow past max_model_len: here an 11-token prompt fully hit by the connector needs 6 of
the 7 free blocks, the reservation 2 more, every step, forever (max_model_len 12, block 2).
"""
# kvspec fix: kvspec/harness/patches/fixes/async-load-reservation-past-max-model-len.diff

import json

import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, SpeculativeConfig, VllmConfig)
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
        # spec decode with the model-free "ngram" method, 2 speculative tokens
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                             prompt_lookup_max=2, prompt_lookup_min=1),
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


def runner_output(scheduler_output, invalid_block_ids=(), finished_recving=()):
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[5] for _ in req_ids],
        kv_connector_output=KVConnectorOutput(finished_recving=set(finished_recving) or None,
                                              invalid_block_ids=set(invalid_block_ids)))


def test_async_load_near_max_model_len_is_admitted(tmp_path):
    # 7 blocks plus vLLM's null block 0: one request of max_model_len (12 tokens) fits
    scheduler = make_scheduler(tmp_path, num_blocks=8, max_num_batched_tokens=4,
                               max_num_seqs=1, max_model_len=12, policy="recompute")
    prompt = [1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]
    ScriptedConnector.HITS = {"r0": len(prompt)}  # an async hit on the whole prompt
    ScriptedConnector.ASYNC = True
    r0 = make_request("r0", prompt)
    scheduler.add_request(r0)

    # No faults: every load the connector starts finishes at the next step.
    admitted = False
    for _ in range(5):
        out = scheduler.schedule()
        if "r0" in out.num_scheduled_tokens:
            break
        loading = r0.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        admitted |= loading
        scheduler.update_from_output(
            out, runner_output(out, finished_recving={"r0"} if loading else ()))
    assert admitted, (
        f"r0's async load never admitted in 5 steps: {r0.status.name}, "
        f"{scheduler.kv_cache_manager.block_pool.get_num_free_blocks()} free blocks, "
        f"spec decode step reserves {scheduler._spec_decode_step_blocks} blocks")
    assert "r0" in out.num_scheduled_tokens, f"r0 never scheduled: {r0.status.name}"
