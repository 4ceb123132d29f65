"""vLLM v1 scheduler: a one-token prompt fully hit by an async load loops forever when the
connector offers the same async hit again after the load finished.

When the load is reported, ``_update_waiting_for_remote_kv`` sets ``num_computed_tokens`` to
``num_tokens - 1 = 0``, so the next scheduling pass treats the request as fresh: a new
lookup and ``get_num_new_matched_tokens`` query start another load, and it never runs. No
in-tree connector re-offers a finished load (P/D connectors clear their remote-prefill flag,
store connectors offer whole blocks only), so this documents behaviour: a strict xfail.
"""
# kvspec fix: none (a connector-contract question; kvspec/harness/patches/fixes/ has no fix
# for it, and kvspec's reference model does not re-query a request whose load finished)

import json

import pytest
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

BLOCK_SIZE = 3
HASH_FN = get_hash_fn_by_name("sha256")


class ScriptedConnector(KVConnectorBase_V1):
    """Scheduler-side connector: the external store holds HITS[req_id] prompt tokens."""

    HITS: dict[str, int] = {}
    ASYNC = False
    LOADS: list[str] = []  # one entry per load started

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = max(0, self.HITS.get(request.request_id, 0) - num_computed_tokens)
        return n, self.ASYNC and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            self.LOADS.append(request.request_id)

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


def runner_output(scheduler_output, invalid_block_ids=(), finished_recving=()):
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[5] for _ in req_ids],
        kv_connector_output=KVConnectorOutput(finished_recving=set(finished_recving) or None,
                                              invalid_block_ids=set(invalid_block_ids)))


@pytest.mark.xfail(strict=True, reason=(
    "documents vLLM's behaviour with a connector that re-offers a one-token async hit after "
    "the load finished: the request loops through WAITING_FOR_REMOTE_KVS forever; in-tree "
    "connectors never re-offer such a hit, and kvspec does not change vLLM here"))
def test_one_token_prompt_async_hit_is_scheduled(tmp_path):
    scheduler = make_scheduler(tmp_path, num_blocks=9, max_num_batched_tokens=16,
                               max_num_seqs=4, max_model_len=32, policy="recompute")
    # A stateless store: it holds the one prompt token and offers it, async, at every query.
    ScriptedConnector.HITS = {"r0": 1}
    ScriptedConnector.ASYNC = True
    ScriptedConnector.LOADS = []
    r0 = make_request("r0", [1], max_tokens=2)
    scheduler.add_request(r0)

    # No faults: every load the connector starts finishes at the next step.
    for _ in range(10):
        out = scheduler.schedule()
        if "r0" in out.num_scheduled_tokens:
            break
        loading = {"r0"} if r0.status == RequestStatus.WAITING_FOR_REMOTE_KVS else set()
        scheduler.update_from_output(out, runner_output(out, finished_recving=loading))
    assert "r0" in out.num_scheduled_tokens, (
        f"r0 never scheduled in 10 steps: {r0.status.name}, "
        f"{len(ScriptedConnector.LOADS)} loads started")
