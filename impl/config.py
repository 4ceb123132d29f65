"""Configuration of the reference scheduler, validated when built with the same
bounds as the spec's ``Config`` (``kvspec.spec.state.LIMITS``)."""
from __future__ import annotations

import attrs

from kvspec.spec.state import (FAILURE_POLICIES, KV_ROLES, LIMITS, MAX_KV_TOKENS, POLICIES,
                               GroupSpec, get_default_kv_delivery)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _within_limits(instance, attribute, value):
    """An integer within ``LIMITS[attribute.name]`` (inclusive)."""
    lo, hi = LIMITS[attribute.name]
    if not _is_int(value):
        raise TypeError(f"{attribute.name} must be an integer, got {value!r:.60}")
    if value < lo:
        raise ValueError(f"{attribute.name} must be >= {lo}, got {value}")
    if value > hi:
        raise ValueError(f"{attribute.name} must be <= {hi}, got {value}")


def _block_sizes(instance, attribute, value):
    lo, hi = LIMITS["block_size"]
    if not isinstance(value, tuple):
        raise TypeError(f"block_sizes must be a tuple of integers, got {value!r:.60}")
    if not value:
        raise ValueError("block_sizes must name at least one block size, got ()")
    if len(value) > LIMITS["groups"][1]:
        raise ValueError(f"block_sizes names {len(value)} KV cache groups, at most "
                         f"{LIMITS['groups'][1]}")
    for size in value:
        if not _is_int(size) or not lo <= size <= hi:
            raise ValueError(f"block_sizes must be integers in {lo}..{hi}, got {value!r:.60}")


def _one_of(options: tuple[str, ...]):
    def check(instance, attribute, value):
        if not isinstance(value, str) or value not in options:
            raise ValueError(f"{attribute.name} must be one of {', '.join(map(repr, options))}, "
                             f"got {value!r:.60}")
    return check


def _boolean(instance, attribute, value):
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be True or False, got {value!r:.60}")


@attrs.frozen
class SchedulerConfig:
    block_sizes: tuple[int, ...] = attrs.field(default=(4,), validator=_block_sizes)
    num_blocks: int = attrs.field(default=64, validator=_within_limits)
    max_num_batched_tokens: int = attrs.field(default=64, validator=_within_limits)
    max_num_seqs: int = attrs.field(default=8, validator=_within_limits)
    max_model_len: int = attrs.field(default=64, validator=_within_limits)
    long_prefill_token_threshold: int = attrs.field(default=0, validator=_within_limits)
    policy: str = attrs.field(default="fcfs", validator=_one_of(POLICIES))
    kv_load_failure_policy: str = attrs.field(default="recompute",
                                              validator=_one_of(FAILURE_POLICIES))
    enable_prefix_caching: bool = attrs.field(default=True, validator=_boolean)
    #: schedule step N+1 before step N's output is applied (see impl/in_flight.py)
    async_scheduling: bool = attrs.field(default=False, validator=_boolean)
    #: "kv_both" (loads and stores), "kv_consumer" (loads only) or "kv_producer"
    #: (stores only): only a consumer's loads race a step in flight, so only
    #: then are frees fenced
    kv_role: str = attrs.field(default="kv_both", validator=_one_of(KV_ROLES))
    #: False: the scheduler runs without a KV connector
    kv_connector: bool = attrs.field(default=True, validator=_boolean)
    #: the connector's ``requires_kv_delivery``: a preemption drops the output
    #: in flight (True) or lets it be delivered, the request resuming once it
    #: drained (False); see impl/in_flight.py
    requires_kv_delivery: bool = attrs.field(
        default=attrs.Factory(lambda c: get_default_kv_delivery(c.kv_connector, c.kv_role),
                              takes_self=True), validator=_boolean)
    #: async scheduling only: placeholder drafts reserved per decode step (the
    #: worker's drafter fills them; see impl/in_flight.py)
    num_speculative_tokens: int = attrs.field(default=0, validator=_within_limits)
    #: the KV cache groups with their kinds (``spec/groups.py``); by default one
    #: full-attention group per entry of ``block_sizes``
    groups: tuple = attrs.field(default=())

    def __attrs_post_init__(self) -> None:
        if not self.groups:
            object.__setattr__(self, "groups", tuple(GroupSpec(b) for b in self.block_sizes))
        if not all(isinstance(g, GroupSpec) for g in self.groups) or \
                tuple(g.block_size for g in self.groups) != self.block_sizes:
            raise ValueError(f"groups {self.groups!r:.80} must be GroupSpecs with the "
                             f"block_sizes {self.block_sizes}")
        if self.groups[0].kind != "full_attention":
            raise ValueError("the first KV cache group must be full attention")
        sizes = sorted(set(self.block_sizes))
        if len(sizes) > 1 and {g.kind for g in self.groups} != {"full_attention",
                                                                 "sliding_window"}:
            raise ValueError(f"block_sizes {sizes}: groups of different block sizes are "
                             "modelled for full attention beside sliding window only")
        if self.requires_kv_delivery and not self.kv_connector:
            raise ValueError("requires_kv_delivery needs a KV connector (kv_connector)")
        if self.num_speculative_tokens and not self.async_scheduling:
            raise ValueError("num_speculative_tokens applies to async scheduling only "
                             "(synchronous drafts come through update_draft_token_ids)")
        slots = self.num_blocks * max(self.block_sizes)
        if slots > MAX_KV_TOKENS:
            raise ValueError(f"num_blocks * block_size = {slots} KV token slots, more than "
                             f"the {MAX_KV_TOKENS} kvspec allows")

    @property
    def is_kv_consumer(self) -> bool:
        """The connector loads KV into the scheduler's blocks."""
        return self.kv_connector and self.kv_role in ("kv_both", "kv_consumer")

    @property
    def block_size(self) -> int:
        return self.block_sizes[0]
