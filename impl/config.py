"""Configuration of the reference scheduler."""
from __future__ import annotations

import attrs


def _int_at_least(least: int):
    def check(instance, attribute, value):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{attribute.name} must be an integer, got {value!r:.60}")
        if value < least:
            raise ValueError(f"{attribute.name} must be >= {least}, got {value}")
    return check


_positive = _int_at_least(1)


def _block_sizes(instance, attribute, value):
    if not isinstance(value, tuple):
        raise TypeError(f"block_sizes must be a tuple of integers, got {value!r:.60}")
    if not value:
        raise ValueError("block_sizes must name at least one block size, got ()")
    for size in value:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"block_sizes must be positive integers, got {value!r:.60}")
    if len(set(value)) != 1:
        raise ValueError(f"block_sizes {value!r:.60}: groups of different block sizes need "
                         "hybrid groups, which the reference scheduler does not have")


def _boolean(instance, attribute, value):
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be True or False, got {value!r:.60}")


@attrs.frozen
class SchedulerConfig:
    block_sizes: tuple[int, ...] = attrs.field(default=(4,), validator=_block_sizes)
    num_blocks: int = attrs.field(default=64, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=64, validator=_positive)
    max_num_seqs: int = attrs.field(default=8, validator=_positive)
    max_model_len: int = attrs.field(default=64, validator=_positive)
    long_prefill_token_threshold: int = attrs.field(default=0, validator=_int_at_least(0))
    policy: str = attrs.field(default="fcfs", validator=attrs.validators.in_(("fcfs", "priority")))
    kv_load_failure_policy: str = attrs.field(
        default="recompute", validator=attrs.validators.in_(("recompute", "fail")))
    enable_prefix_caching: bool = attrs.field(default=True, validator=_boolean)

    @property
    def block_size(self) -> int:
        return self.block_sizes[0]
