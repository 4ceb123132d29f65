"""The abstract state of the scheduler, as every target must expose it.

A target (the reference implementation, a mutant, the installed vLLM) is
observed after every call and mapped into these classes. The spec never looks
at anything else, so two schedulers that agree on an ``Observation`` are the
same scheduler as far as kvspec is concerned.

The state is shaped for several KV cache groups (one block table and one block
size per group) and for async scheduling (``num_output_placeholders``), even
where the current checks exercise one full-attention group and sync scheduling.
"""
from __future__ import annotations

import enum
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
        return self.name.startswith("FINISHED")

    @property
    def is_waiting(self) -> bool:
        return self in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS,
                        RequestStatus.PREEMPTED)


@attrs.frozen
class GroupSpec:
    """One KV cache group: its kind and its block size."""

    block_size: int
    kind: str = "full_attention"


@attrs.frozen
class Config:
    """The scheduler's configuration, as far as the spec needs it."""

    groups: tuple[GroupSpec, ...]
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    kv_load_failure_policy: str = "recompute"
    enable_prefix_caching: bool = True

    @property
    def block_size(self) -> int:
        """The block size of the first (full-attention) group."""
        return self.groups[0].block_size


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
