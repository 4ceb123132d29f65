"""Turn Z3 counterexamples of the refutation obligations into kvspec traces,
so that what Z3 found replays on the mutant (fails) and on the reference (passes)."""
from __future__ import annotations

from pathlib import Path

from kvspec.harness.target import make_config
from kvspec.harness.trace import save_trace


def _prompt(n: int) -> list[int]:
    return [1 + (i % 7) for i in range(n)]


def trace_pre_34616(cex: dict):
    """Async load of ``external`` tokens of a ``num_tokens`` prompt, block size from Z3."""
    bs, n, ext = cex["s.block_size"], cex["s.num_tokens"], cex["a0.num_external"]
    config = make_config(block_size=bs, num_blocks=-(-n // bs) + 4, max_model_len=n + 6,
                         max_num_batched_tokens=32)
    actions = [{"op": "add", "id": "r0", "prompt": _prompt(n), "max_tokens": 2, "ext": ext,
                "async": True},
               {"op": "step"}, {"op": "step", "finish_loads": ["r0"]}, {"op": "drain"}]
    return "mutant:async_block_rounding", config, actions


def trace_truncate_past_first_invalid(cex: dict):
    """A sync load of the whole prompt whose block ``first_invalid`` fails."""
    bs, n, f = cex["s.block_size"], cex["s.num_computed"], cex["first_invalid"]
    config = make_config(block_size=bs, num_blocks=-(-n // bs) + 4, max_model_len=n + 6,
                         max_num_batched_tokens=32)
    actions = [{"op": "add", "id": "r0", "prompt": _prompt(n), "max_tokens": 2, "ext": n},
               {"op": "step", "fail": ["r0"], "fail_offset": f}, {"op": "drain"}]
    return "mutant:truncate_past_first_invalid", config, actions


def trace_stats_reset(cex: dict):
    """First scheduling with no hits; a preemption (priority policy, small pool);
    the re-scheduling hits the offloading store, so external hits exceed the
    cached count kept from the first scheduling."""
    n = cex["s.prompt_len"]
    config = make_config(block_size=2, num_blocks=4, max_num_batched_tokens=16, max_model_len=8,
                         policy="priority")
    actions = [{"op": "add", "id": "r0", "prompt": _prompt(n), "max_tokens": 4, "priority": 1,
                "offload": True},
               {"op": "step"},
               {"op": "add", "id": "r1", "prompt": [11, 12, 13], "max_tokens": 4},
               {"op": "step"}, {"op": "step"}, {"op": "step"}, {"op": "drain"}]
    return "mutant:stats_reset_on_reschedule", config, actions


TRACE_BUILDERS = {
    "refute_stats_reset_on_reschedule": trace_stats_reset,
    "refute_pre_34616_rounding": trace_pre_34616,
    "refute_reference_truncation_past_first_invalid": trace_truncate_past_first_invalid,
}


def is_seed_kind(cex: dict) -> bool:
    """External hits end mid-block, before the prompt end (seed 000's case)."""
    external, size = cex["a0.num_external"], cex["s.block_size"]
    return external % size != 0 and external < cex["s.num_tokens"]


def write_trace(name: str, cex: dict, out_dir: Path) -> tuple[str, Path] | None:
    builder = TRACE_BUILDERS.get(name)
    if builder is None:
        return None
    target, config, actions = builder(cex)
    path = out_dir / f"{name}.json"
    save_trace(path, target=target, config=config, actions=actions)
    return target, path
