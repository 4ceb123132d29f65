"""A vLLM scheduler's configuration as kvspec's ``Config``, for a scheduler
someone else built (``kvspec/harness/watch.py``): its KV cache groups by what
their specs inherit, its limits, its roles; or ``Unmappable`` with the reason."""
from __future__ import annotations

import attrs

from kvspec.harness.vllm_observe import NULL_BLOCKS
from kvspec.spec.state import (Config, GroupSpec, check_block_sizes, get_hash_block_size,
                               get_scheduler_block_size)


class Unmappable(Exception):
    """A scheduler kvspec's state cannot describe (its reason is the message)."""


def get_group_spec(spec) -> GroupSpec:
    """kvspec's view of one KV cache group's spec (by its class and what it
    inherits: an MLA full-attention spec is full attention), or ``Unmappable``."""
    kinds = {c.__name__ for c in type(spec).__mro__}
    name, mode = type(spec).__name__, getattr(spec, "mamba_cache_mode", None)
    compressed = getattr(spec, "tokens_per_state", 1)  # -1 where it does not apply
    if isinstance(compressed, int) and compressed > 1:
        raise Unmappable(f"a {name} group compressing {compressed} tokens per state")
    if "FullAttentionSpec" in kinds:
        return GroupSpec(spec.block_size)
    if "SlidingWindowSpec" in kinds and getattr(spec, "bounded_replay", False):
        raise Unmappable(f"a {name} group with bounded prefix replay (a hit recomputes its "
                         "last window), which kvspec does not model")
    if "SlidingWindowSpec" in kinds and getattr(spec, "extra_retained_tokens", 0):
        raise Unmappable(f"a {name} group retaining {spec.extra_retained_tokens} tokens below "
                         "its window, which kvspec does not model")
    if "SlidingWindowSpec" in kinds:
        return GroupSpec(spec.block_size, "sliding_window", spec.sliding_window)
    if "MambaSpec" in kinds and mode == "align":
        return GroupSpec(spec.block_size, "last_state")
    raise Unmappable(f"a {name}{f' ({mode} mode)' if mode else ''} KV cache group")


def check_watched_groups(instance, attribute, value) -> None:
    """A watched scheduler's groups: any count kvspec's state holds, of one
    block size, the first full attention or (a model of windowed layers only)
    a sliding window."""
    if not value or not all(isinstance(g, GroupSpec) for g in value):
        raise ValueError("groups: none kvspec maps")
    if value[0].kind not in ("full_attention", "sliding_window"):
        raise ValueError(f"groups: the first KV cache group is {value[0].kind}")
    check_block_sizes(value)


@attrs.frozen
class WatchedConfig(Config):
    """A watched scheduler's configuration. kvspec's bounds on its own runs
    (the KV slots, which keep them from allocating gigabytes; the drafts the
    environment draws) do not apply to a scheduler vLLM's test built and
    kvspec only observes. A sliding-window first
    group (a model whose layers are all windowed) names the prefix as a full
    group 0 does: its block hashes are the request's."""

    groups: tuple[GroupSpec, ...] = attrs.field(validator=check_watched_groups, kw_only=True)
    #: vLLM's own tests reserve up to 31 drafts; kvspec's runs draw at most 2
    num_speculative_tokens: int = attrs.field(default=0, kw_only=True,
                                              validator=attrs.validators.ge(0))

    def __attrs_post_init__(self) -> None:
        pass


def is_async_scheduler(s) -> bool:
    return any(c.__name__ == "AsyncScheduler" for c in type(s).__mro__)


def is_producer_only(transfer) -> bool:
    """A P/D prefill node: its connector stores and never loads."""
    return bool(getattr(transfer, "is_kv_producer", False)) and not getattr(
        transfer, "is_kv_consumer", True)


def get_kv_role(transfer) -> str:
    """kvspec's role of vLLM's connector: both, consumer (loads only) or producer."""
    if is_producer_only(transfer):
        return "kv_producer"
    if transfer is not None and not getattr(transfer, "is_kv_producer", True):
        return "kv_consumer"
    return "kv_both"


def get_connector_fields(s) -> dict:
    """Whether the scheduler has a connector, its role and whether it requires
    KV delivery (vLLM's own flag where the release has one)."""
    transfer = getattr(s.vllm_config, "kv_transfer_config", None)
    if getattr(s, "connector", None) is None:
        return {"kv_connector": False, "requires_kv_delivery": False}
    role = get_kv_role(transfer)
    delivery = getattr(s, "requires_kv_delivery", None)
    return {"kv_role": role, **({} if delivery is None
                                else {"requires_kv_delivery": bool(delivery)})}


def check_scheduler_block_sizes(s, groups) -> None:
    """Groups of two block sizes: the scheduler must hash in their greatest
    common divisor and end hits on their least common multiple, as vLLM's
    engine sets it up (``resolve_kv_cache_block_sizes``) and kvspec's
    ``Config`` derives; a test that builds it otherwise is ``Unmappable``."""
    sizes = [g.block_size for g in groups]
    if len(set(sizes)) == 1:
        return
    hashing, scheduling = get_hash_block_size(groups), get_scheduler_block_size(groups)
    found = (getattr(s, "hash_block_size", None), getattr(s, "block_size", None))
    if found != (hashing, scheduling):
        raise Unmappable(f"groups of block sizes {sorted(set(sizes))} with hash block and "
                         f"scheduler block {found}, not ({hashing}, {scheduling})")
    coordinator = getattr(s.kv_cache_manager, "coordinator", None)
    if getattr(coordinator, "enable_partial_hash_hits", False):
        raise Unmappable("prefix hits inside a block (partial hash hits), which kvspec "
                         "does not model")


def get_config(s) -> Config:
    """kvspec's ``Config`` of a vLLM scheduler, or ``Unmappable``."""
    groups = tuple(get_group_spec(g.kv_cache_spec) for g in s.kv_cache_config.kv_cache_groups)
    if not groups:
        raise Unmappable("no KV cache group (an attention-free model)")
    check_scheduler_block_sizes(s, groups)
    is_async = is_async_scheduler(s)
    transfer = getattr(s.vllm_config, "kv_transfer_config", None)
    try:
        return WatchedConfig(
            groups=groups, num_blocks=s.kv_cache_config.num_blocks - NULL_BLOCKS,
            max_num_batched_tokens=s.max_num_scheduled_tokens, max_num_seqs=s.max_num_running_reqs,
            max_model_len=s.max_model_len,
            long_prefill_token_threshold=s.scheduler_config.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=bool(getattr(
                s.scheduler_config, "long_prefill_token_threshold_adaptive", False)),
            **get_connector_fields(s),
            policy=s.policy.value, enable_prefix_caching=s.cache_config.enable_prefix_caching,
            kv_load_failure_policy=getattr(transfer, "kv_load_failure_policy", None) or "fail",
            async_scheduling=is_async,
            num_speculative_tokens=getattr(s, "num_spec_tokens", 0) if is_async else 0)
    except (ValueError, TypeError) as exc:
        raise Unmappable(f"outside kvspec's limits: {exc}") from None
