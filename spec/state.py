"""The abstract state of the scheduler, as every target must expose it.

A target (the reference implementation, a mutant, the installed vLLM) is
observed after every call and mapped into these classes. The spec never looks
at anything else, so two schedulers that agree on an ``Observation`` are the
same scheduler as far as kvspec is concerned.

The state holds several KV cache groups (one block table per group, each of
its kind: full attention, sliding window, last state; see ``spec/groups.py``)
and async scheduling (``num_output_placeholders``).
"""
from __future__ import annotations

import enum
import math
from typing import Hashable

import attrs

#: ``num_cached_tokens`` before the request's cache-hit stats were recorded.
STATS_UNSET = -1


class RequestStatus(enum.Enum):
    WAITING = "WAITING"
    WAITING_FOR_REMOTE_KVS = "WAITING_FOR_REMOTE_KVS"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    FINISHED_STOPPED = "FINISHED_STOPPED"
    FINISHED_LENGTH_CAPPED = "FINISHED_LENGTH_CAPPED"
    FINISHED_ABORTED = "FINISHED_ABORTED"
    FINISHED_ERROR = "FINISHED_ERROR"

    @property
    def is_finished(self) -> bool:
        return self._finished  # the statuses named FINISHED_*

    @property
    def is_waiting(self) -> bool:
        return self._waiting  # WAITING, WAITING_FOR_REMOTE_KVS, PREEMPTED


_FINISHED = frozenset(s for s in RequestStatus if s.name.startswith("FINISHED"))
# worked out once per status: every claim asks of every request (an enum's
# hash is a Python call)
for _status in RequestStatus:
    _status._finished = _status in _FINISHED
    _status._waiting = _status.name in ("WAITING", "WAITING_FOR_REMOTE_KVS", "PREEMPTED")

#: the most drafts a step schedules per request (vLLM's ``num_speculative_tokens``
#: on the vLLM target; the environment proposes 0 to this many)
MAX_DRAFTS = 4
#: the drafts a synchronous step may be proposed (``update_draft_token_ids``):
#: the vLLM target configures this many, so traces recorded before 4 drafts
#: replay as they ran (a new request is padded to 1 + this many rows)
SYNC_MAX_DRAFTS = 2

#: Bounds on a configuration (inclusive): wide enough for every run kvspec makes
#: (the benchmarks' largest pool, N=256, has 3,328 blocks), narrow enough that no
#: configuration allocates gigabytes or steps for hours (a step observes the whole
#: pool: about 2 µs a block). max_model_len is at least 2: a prompt of one token
#: and room for one output token, or no request could ever be added.
LIMITS = {"block_size": (1, 1024), "num_blocks": (1, 16_384), "groups": (1, 8),
          "max_num_batched_tokens": (1, 1 << 20), "max_num_seqs": (1, 4096),
          "max_model_len": (2, 8192), "long_prefill_token_threshold": (0, 1 << 20),
          "num_speculative_tokens": (0, MAX_DRAFTS), "max_concurrent_batches": (2, 4)}
#: the most KV token slots (num_blocks * block_size) a configuration may have
MAX_KV_TOKENS = 1 << 22
#: full attention reads every earlier position; a sliding window the last
#: ``sliding_window`` positions; a last-state group (Mamba-like) only the state
#: after the previous token (``spec/groups.py``)
GROUP_KINDS = ("full_attention", "sliding_window", "last_state")
#: steps in flight under async scheduling by default: vLLM's batch queue holds
#: ``max_concurrent_batches`` of them, 2 without pipeline parallelism (up to the
#: pipeline's depth with it: ``Config.max_concurrent_batches``)
BATCH_QUEUE_DEPTH = 2
POLICIES = ("fcfs", "priority")
FAILURE_POLICIES = ("recompute", "fail")
KV_ROLES = ("kv_both", "kv_consumer", "kv_producer")


def get_default_kv_delivery(kv_connector: bool, kv_role: str) -> bool:
    """vLLM's default ``requires_kv_delivery``: a producer hands KV off."""
    return kv_connector and kv_role != "kv_consumer"


def _bounded_int(instance, attribute, value) -> None:
    lo, hi = LIMITS[attribute.name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be an integer, got {value!r:.60}")
    if not lo <= value <= hi:
        raise ValueError(f"{attribute.name} must be in {lo}..{hi}, got {value}")


def _one_of(options):
    def check(instance, attribute, value) -> None:
        if not isinstance(value, str) or value not in options:
            raise ValueError(f"{attribute.name} must be one of {', '.join(options)}, "
                             f"got {value!r:.60}")
    return check


def _boolean(instance, attribute, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be true or false, got {value!r:.60}")


def _groups(instance, attribute, value) -> None:
    lo, hi = LIMITS["groups"]
    if not isinstance(value, tuple) or not all(isinstance(g, GroupSpec) for g in value):
        raise TypeError(f"groups must be a tuple of GroupSpec, got {value!r:.60}")
    if not lo <= len(value) <= hi:
        raise ValueError(f"groups must hold {lo} to {hi} KV cache groups, got {len(value)}")
    if value[0].kind != "full_attention":
        # group 0 names the prefix (its block hashes) every other group aligns to
        raise ValueError(f"groups: the first KV cache group must be full attention, "
                         f"got {value[0].kind}")
    check_block_sizes(value)


def check_block_sizes(groups) -> None:
    """Groups of different block sizes are full attention beside a sliding
    window: a larger Mamba block keeps a state per hash block (vLLM's partial
    hash hits), and full attention alone has no reason to mix; neither is
    modelled. ValueError otherwise."""
    sizes = sorted({g.block_size for g in groups})
    if len(sizes) > 1 and {g.kind for g in groups} != {"full_attention", "sliding_window"}:
        raise ValueError(f"groups: block sizes {sizes} differ; kvspec models different "
                         "block sizes for full attention beside sliding window only, got "
                         f"{', '.join(g.kind for g in groups)}")


def get_hash_block_size(groups) -> int:
    """Tokens per block hash: the greatest common divisor of the groups'
    block sizes (vLLM's ``hash_block_size``). A group's block of ``k`` hash
    blocks is named by the last of them (``spec/groups.py``)."""
    return math.gcd(*(g.block_size for g in groups))


def get_scheduler_block_size(groups) -> int:
    """Tokens per scheduler block: the least common multiple of the groups'
    block sizes. A prefix hit ends on a multiple of it, where every group's
    blocks end (vLLM's ``scheduler_block_size``)."""
    return math.lcm(*(g.block_size for g in groups))


def _window(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"sliding_window must be an integer, got {value!r:.60}")
    if instance.kind == "sliding_window" and not 1 <= value <= LIMITS["max_model_len"][1]:
        raise ValueError(f"a sliding_window group needs a window of 1.."
                         f"{LIMITS['max_model_len'][1]} tokens, got {value}")
    if instance.kind != "sliding_window" and value != 0:
        raise ValueError(f"sliding_window applies to sliding_window groups only, "
                         f"not {instance.kind}")


@attrs.frozen
class GroupSpec:
    """One KV cache group: its kind and its block size (and a sliding window's
    width in tokens)."""

    block_size: int = attrs.field(validator=_bounded_int)
    kind: str = attrs.field(default="full_attention", validator=_one_of(GROUP_KINDS))
    sliding_window: int = attrs.field(default=0, validator=_window)


@attrs.frozen
class Config:
    """The scheduler's configuration, as far as the spec needs it. Validated
    when built: types, positive sizes and the bounds in ``LIMITS``."""

    groups: tuple[GroupSpec, ...] = attrs.field(validator=_groups)
    num_blocks: int = attrs.field(validator=_bounded_int)
    max_num_batched_tokens: int = attrs.field(validator=_bounded_int)
    max_num_seqs: int = attrs.field(validator=_bounded_int)
    max_model_len: int = attrs.field(validator=_bounded_int)
    long_prefill_token_threshold: int = attrs.field(default=0, validator=_bounded_int)
    #: vLLM's ``long_prefill_token_threshold_adaptive``: the cap is floored at a
    #: fair share of the token budget (``max_num_batched_tokens`` / eligible)
    long_prefill_token_threshold_adaptive: bool = attrs.field(default=False,
                                                              validator=_boolean)
    policy: str = attrs.field(default="fcfs", validator=_one_of(POLICIES))
    kv_load_failure_policy: str = attrs.field(default="recompute",
                                              validator=_one_of(FAILURE_POLICIES))
    enable_prefix_caching: bool = attrs.field(default=True, validator=_boolean)
    #: vLLM's default for generation models since 0.32: step N+1 is scheduled
    #: before step N's output is applied (``AsyncScheduler`` driven as
    #: ``EngineCore.step_with_batch_queue`` does, ``BATCH_QUEUE_DEPTH`` steps deep)
    async_scheduling: bool = attrs.field(default=False, validator=_boolean)
    #: the connector's role: "kv_both" loads and stores (an offloading store, a
    #: P/D node that does both); "kv_consumer" only loads (a P/D decode node:
    #: requests arrive with ``do_remote_prefill``); "kv_producer" only stores (a
    #: P/D prefill node), so nothing is loaded and, under async scheduling, vLLM
    #: frees blocks at once instead of fencing them behind the step in flight
    #: (``defer_block_free`` is for consumers)
    kv_role: str = attrs.field(default="kv_both", validator=_one_of(KV_ROLES))
    #: False: no KV connector at all (vLLM's ``kv_transfer_config`` is None):
    #: nothing loads, nothing sends, no frees are fenced
    kv_connector: bool = attrs.field(default=True, validator=_boolean)
    #: the connector's ``requires_kv_delivery``: a request preempted with output
    #: in flight has that output dropped (it samples those positions again) when
    #: True, delivered (appended, rolling nothing back; the request resumes only
    #: once it drained) when False. vLLM's default is the producer role; a
    #: best-effort cache (the offloading connectors) opts out
    requires_kv_delivery: bool = attrs.field(
        default=attrs.Factory(lambda c: get_default_kv_delivery(c.kv_connector, c.kv_role),
                              takes_self=True), validator=_boolean)
    #: spec decode under async scheduling: the drafts the scheduler reserves for
    #: each decode step, as ``-1`` placeholders the worker's drafter fills (vLLM's
    #: ``num_speculative_tokens``). Synchronous runs take drafts from the
    #: environment after each step (``update_draft_token_ids``) and leave it 0.
    num_speculative_tokens: int = attrs.field(default=0, validator=_bounded_int)
    #: async scheduling: the steps in flight at most (vLLM's batch queue,
    #: ``max_concurrent_batches``: 2, or the pipeline-parallel depth)
    max_concurrent_batches: int = attrs.field(default=BATCH_QUEUE_DEPTH, validator=_bounded_int)

    @property
    def is_kv_consumer(self) -> bool:
        """The connector loads KV into the scheduler's blocks."""
        return self.kv_connector and self.kv_role in ("kv_both", "kv_consumer")

    @property
    def is_kv_producer(self) -> bool:
        """The connector stores (sends) a finished request's KV."""
        return self.kv_connector and self.kv_role in ("kv_both", "kv_producer")

    @property
    def num_steps_in_flight(self) -> int:
        """The batch queue's depth: 1 when synchronous."""
        return self.max_concurrent_batches if self.async_scheduling else 1

    def __attrs_post_init__(self) -> None:
        if self.num_speculative_tokens and not self.async_scheduling:
            raise ValueError("num_speculative_tokens applies to async scheduling only "
                             "(synchronous runs take drafts from the environment)")
        if self.max_concurrent_batches != BATCH_QUEUE_DEPTH and not self.async_scheduling:
            raise ValueError("max_concurrent_batches applies to async scheduling only")
        if self.requires_kv_delivery and not self.kv_connector:
            raise ValueError("requires_kv_delivery needs a KV connector (kv_connector)")
        slots = self.num_blocks * max(g.block_size for g in self.groups)
        if slots > MAX_KV_TOKENS:
            raise ValueError(f"num_blocks * block_size = {slots} KV token slots, more than "
                             f"the {MAX_KV_TOKENS} kvspec allows")

    @property
    def block_size(self) -> int:
        """The block size of the first (full-attention) group."""
        return self.groups[0].block_size

    @property
    def hash_block_size(self) -> int:
        return get_hash_block_size(self.groups)

    @property
    def scheduler_block_size(self) -> int:
        return get_scheduler_block_size(self.groups)

    @property
    def has_mixed_block_sizes(self) -> bool:
        return len({g.block_size for g in self.groups}) > 1

    @property
    def is_hybrid(self) -> bool:
        """Some group is not full attention (vLLM's hybrid KV cache manager)."""
        return any(g.kind != "full_attention" for g in self.groups)


@attrs.frozen
class RequestView:
    """One request as the spec sees it."""

    request_id: str
    status: RequestStatus
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    max_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    num_external_computed_tokens: int
    num_preemptions: int
    block_ids: tuple[tuple[int, ...], ...]
    block_hashes: tuple[Hashable, ...] = ()
    spec_token_ids: tuple[int, ...] = ()
    num_output_placeholders: int = 0
    priority: int = 0
    eos_token_id: int | None = None
    #: token ids besides EOS that end the request (vLLM's ``stop_token_ids``)
    stop_token_ids: tuple[int, ...] = ()
    #: outputs before which a stop token need not end it (``min_tokens``)
    min_tokens: int = 0
    #: False for a request that samples nothing: a pooling request, or any
    #: request on an encoder-only instance; it ends FINISHED_STOPPED with no
    #: output once its prompt is computed, and may fill all ``max_model_len``
    samples_tokens: bool = True
    #: vLLM's repetition detection is on for it (``repetition_detection``): a
    #: repeated pattern, which kvspec does not model, may stop it too
    detects_repetition: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def has_stats(self) -> bool:
        return self.num_cached_tokens != STATS_UNSET


@attrs.frozen
class PoolView:
    """The block pool: reference counts, the free queue (eviction order) and
    the prefix cache (block hash -> block ids holding that content)."""

    ref_cnt: tuple[int, ...]
    free_queue: tuple[int, ...]
    cached: tuple[tuple[Hashable, int], ...]
    #: blocks freed while a step in flight may still write them, held back from
    #: the free queue until that step's output is processed (vLLM's deferred
    #: frees under async scheduling with a consumer connector), one entry per
    #: reference held
    fenced: tuple[int, ...] = ()
    #: references a real connector's scheduler side holds on blocks it
    #: transfers (vLLM's ``BlockPool.touch``: SimpleCPUOffload's and
    #: MooncakeStore's in-flight stores and loads), one entry per reference
    pinned: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.ref_cnt)


@attrs.frozen
class Observation:
    """Everything the spec reads of a target at one instant."""

    config: Config
    requests: dict[str, RequestView]
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    pool: PoolView
    #: request ids finished but still holding blocks for a KV send (delayed free)
    sending: tuple[str, ...] = ()


@attrs.frozen
class StepView:
    """What one ``schedule()`` call decided: the scheduler output, observed."""

    num_scheduled_tokens: dict[str, int]
    #: num_computed_tokens of each scheduled request before this step
    num_computed_before: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, tuple[int, ...]]
    new_req_ids: tuple[str, ...]
    resumed_req_ids: tuple[str, ...]
    preempted_req_ids: frozenset[str]
    #: the blocks the output tells the worker of, per scheduled request and group:
    #: a new or resumed request's whole table, another's blocks allocated since
    #: (None: none). Empty where a target does not say (spec/worker.py)
    new_block_ids: dict[str, tuple[tuple[int, ...], ...] | None] = attrs.Factory(dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@attrs.frozen
class WorkerOutcome:
    """What the (modelled) worker reports back for one step."""

    sampled_token_ids: dict[str, tuple[int, ...]]
    finished_recving: frozenset[str] = frozenset()
    finished_sending: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
