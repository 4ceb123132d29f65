"""Configuration of the reference scheduler."""
from __future__ import annotations

import attrs


def _positive(instance, attribute, value):
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class SchedulerConfig:
    block_sizes: tuple[int, ...] = attrs.field(default=(4,))
    num_blocks: int = attrs.field(default=64, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=64, validator=_positive)
    max_num_seqs: int = attrs.field(default=8, validator=_positive)
    max_model_len: int = attrs.field(default=64, validator=_positive)
    long_prefill_token_threshold: int = 0
    policy: str = attrs.field(default="fcfs", validator=attrs.validators.in_(("fcfs", "priority")))
    kv_load_failure_policy: str = attrs.field(
        default="recompute", validator=attrs.validators.in_(("recompute", "fail")))
    enable_prefix_caching: bool = True

    @property
    def block_size(self) -> int:
        return self.block_sizes[0]
