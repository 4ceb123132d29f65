"""A Hugging Face cache holding only ``config.json`` for the models vLLM's
scheduler and KV-connector unit tests name, so that they run offline
(``HF_HOME=<dir> HF_HUB_OFFLINE=1``). The scheduler reads the architecture's
sizes only; the values below are the public configs' shape fields.

    python scripts/vllm_test_models.py DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
          "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128009,
          "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
MODELS = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
        "ffn_dim": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768,
        "do_layer_norm_before": True, "activation_function": "relu", "bos_token_id": 2,
        "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16"},
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 1024,
        "ffn_dim": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 512,
        "do_layer_norm_before": False, "activation_function": "relu", "bos_token_id": 2,
        "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16"},
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA,
    "hmellor/tiny-random-LlamaForCausalLM": dict(
        _LLAMA, hidden_size=16, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=4, vocab_size=32000,
        max_position_embeddings=2048),
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
}
SNAPSHOT = "0" * 40


def write_cache(root: Path) -> list[str]:
    for name, config in MODELS.items():
        repo = root / "hub" / f"models--{name.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(SNAPSHOT)
        snap = repo / "snapshots" / SNAPSHOT
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return list(MODELS)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/vllm_test_models.py DIR")
    print("\n".join(write_cache(Path(sys.argv[1]))))
