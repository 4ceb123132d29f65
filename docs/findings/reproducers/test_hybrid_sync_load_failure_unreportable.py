"""vLLM v1 scheduler, hybrid KV cache (full attention + sliding window): a request whose KV
was loaded synchronously has no working way to report that the load failed.

r (20 prompt tokens) gets a sync external hit on 12 of them and runs with
``num_computed_tokens`` 20. The worker finds the load failed. Block ids
(``invalid_block_ids``) make ``_handle_invalid_blocks`` raise, since several groups share
block numbers; the request id (``failed_recving``, which that error points to) goes through
``_handle_failed_recving``, which only looks at WAITING_FOR_REMOTE_KVS requests, so the
running request keeps its 12 failed tokens as computed, samples from them and stays running.
"""
# kvspec fix: none (a scheduler/connector contract gap: kvspec/harness/patches/fixes/ has no
# fix for it; a fix needs the scheduler to accept a running request in failed_recving)

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

BLOCK_SIZE = 4
WINDOW = 8
HASH_FN = get_hash_fn_by_name("sha256")


class ScriptedConnector(KVConnectorBase_V1, SupportsHMA):
    """Scheduler-side HMA connector: the external store holds HITS[req_id] prompt tokens."""

    HITS: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return max(0, self.HITS.pop(request.request_id, 0) - num_computed_tokens), False

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


def make_scheduler(tmp_path, policy, num_blocks=64):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 4096}))
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                 max_model_len=64, dtype="float32"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
            is_encoder_decoder=False, enable_chunked_prefill=True, async_scheduling=False,
            disable_hybrid_kv_cache_manager=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ScriptedConnector", kv_connector_module_path=__name__,
            kv_role="kv_both", kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"))
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = dict(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["full.0"], FullAttentionSpec(**spec)),
        KVCacheGroupSpec(["swa.0"], SlidingWindowSpec(**spec, sliding_window=WINDOW))])
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=BLOCK_SIZE, log_stats=True)


def runner_output(scheduler, scheduler_output, **kv):
    req_ids = list(scheduler_output.num_scheduled_tokens)
    done = [scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
            for r in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[5] if d else [] for d in done],
        kv_connector_output=KVConnectorOutput(**kv))


@pytest.mark.xfail(strict=True, reason=(
    "vLLM 0.31/0.32 with several KV cache groups: invalid_block_ids raises and failed_recving "
    "is ignored for a RUNNING (sync-loaded) request, which keeps its failed tokens as "
    "computed; kvspec has no fix (scheduler/connector contract gap)"), raises=AssertionError)
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_sync_loaded_hybrid_request_can_report_failed_load(tmp_path, policy):
    scheduler = make_scheduler(tmp_path, policy)
    assert len(scheduler.kv_cache_config.kv_cache_groups) == 2
    ScriptedConnector.HITS = {"r": 12}  # a sync hit on 3 of the 5 prompt blocks
    init_none_hash(HASH_FN)
    r = Request("r", list(range(10, 30)), SamplingParams(max_tokens=4), None,
                block_hasher=get_request_block_hasher(BLOCK_SIZE, HASH_FN))
    scheduler.add_request(r)

    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 8}  # 12 loaded + 8 computed in this step
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 20

    # Block-level report: refused for any multi-group layout (raises before any update).
    full_blocks, _ = scheduler.kv_cache_manager.get_block_ids("r")
    with pytest.raises(RuntimeError, match="multiple KV cache groups"):
        scheduler.update_from_output(
            out, runner_output(scheduler, out, invalid_block_ids={full_blocks[0]}))

    # Request-level report, the channel that error names.
    engine_outputs = scheduler.update_from_output(
        out, runner_output(scheduler, out, failed_recving={"r"}))
    emitted = [o.new_token_ids for eco in engine_outputs.values() for o in eco.outputs
               if o.request_id == "r"]
    if policy == "fail":
        assert r.status == RequestStatus.FINISHED_ERROR, (
            f"failed_recving for the running request r was ignored: {r.status.name}, "
            f"num_computed_tokens {r.num_computed_tokens}, emitted {emitted}")
    else:
        assert r.num_computed_tokens < 12, (
            f"failed_recving for the running request r was ignored: num_computed_tokens "
            f"{r.num_computed_tokens} still counts the 12 failed tokens; emitted {emitted}")
    assert [5] not in emitted, f"r emitted a token sampled from failed KV: {emitted}"
