"""The one protocol every target implements, and the reference target."""
from __future__ import annotations

from operator import attrgetter
from typing import Callable, Protocol

import attrs

from kvspec.harness.env import EOS_TOKEN_ID, RequestSpec
from kvspec.harness.frozen import TupleCache, ViewMemo, keep_memos_of
from kvspec.spec.state import (Config, GroupSpec, Observation, PoolView, RequestStatus,
                               RequestView, StepView, WorkerOutcome)

_BLOCK_ID = attrgetter("block_id")


def _get_block_ids(blocks) -> tuple[int, ...]:
    return tuple(map(_BLOCK_ID, blocks))


class TargetStateError(AssertionError):
    """The target reached a state no call may leave it in, found while it was
    observed (a full-attention table holding the null block): the target's
    crash, though raised by kvspec's observer (``runner.describe_crash``)."""


class Target(Protocol):
    name: str
    version: str

    def add_request(self, spec: RequestSpec) -> None: ...
    def schedule(self) -> StepView: ...
    def update_from_output(self, outcome: WorkerOutcome) -> None: ...
    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def reset_prefix_cache(self, running: bool = False) -> bool: ...
    def observe(self) -> Observation: ...
    def observe_request(self, request_id: str) -> RequestView: ...
    def final_view(self, request_id: str) -> RequestView | None:
        """A request that left the scheduler, as it ended (None if unknown)."""


class ImplTarget:
    """The reference implementation, driven through its public calls."""

    name = "impl"
    version = "kvspec-reference"

    def __init__(self, config: Config, connector, scheduler_factory: Callable | None = None):
        from kvspec.impl import Scheduler, SchedulerConfig
        self.config = config
        sched_config = SchedulerConfig(
            block_sizes=tuple(g.block_size for g in config.groups), groups=config.groups,
            num_blocks=config.num_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.policy, kv_load_failure_policy=config.kv_load_failure_policy,
            enable_prefix_caching=config.enable_prefix_caching,
            async_scheduling=config.async_scheduling, kv_role=config.kv_role,
            kv_connector=config.kv_connector, requires_kv_delivery=config.requires_kv_delivery,
            num_speculative_tokens=config.num_speculative_tokens)
        # without a connector the scheduler never asks the environment anything
        self.scheduler = (scheduler_factory or Scheduler)(
            sched_config, connector if config.kv_connector else None)
        self._outputs: list = []  # scheduler outputs whose model output is pending
        self._requests: dict[str, object] = {}  # every request added, to see how it ended
        #: the pool's cache_version when its prefix cache was last read, and what it read
        self._cached_seen: tuple = (None, ())
        #: each live request's last view and what it was built of (``_view``)
        self._seen: dict[str, ViewMemo] = {}
        #: the pool's counts, free queue and fences as last observed
        self._pool_tuples = TupleCache()

    def add_request(self, spec: RequestSpec) -> None:
        from kvspec.impl import Request
        request = Request(spec.request_id, list(spec.prompt), spec.max_tokens,
                          eos_token_id=EOS_TOKEN_ID, priority=spec.priority,
                          hash_block_size=self.config.hash_block_size)
        self.scheduler.add_request(request)
        self._requests[spec.request_id] = request

    def schedule(self) -> StepView:
        out = self.scheduler.schedule()
        self._outputs.append(out)
        return StepView(
            num_scheduled_tokens=dict(out.num_scheduled_tokens),
            num_computed_before=dict(out.num_computed_before),
            scheduled_spec_decode_tokens={k: tuple(v) for k, v in
                                          out.scheduled_spec_decode_tokens.items()},
            new_req_ids=tuple(out.new_req_ids), resumed_req_ids=tuple(out.resumed_req_ids),
            preempted_req_ids=frozenset(out.preempted_req_ids),
            new_block_ids=dict(getattr(out, "new_block_ids", {})))

    def update_from_output(self, outcome: WorkerOutcome) -> None:
        from kvspec.impl.outputs import KVConnectorOutput, ModelRunnerOutput
        kv = KVConnectorOutput(set(outcome.finished_recving), set(outcome.finished_sending),
                               set(outcome.invalid_block_ids))
        runner = ModelRunnerOutput({k: list(v) for k, v in outcome.sampled_token_ids.items()}, kv)
        self.scheduler.update_from_output(self._outputs.pop(0), runner)

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        self.scheduler.update_draft_token_ids(drafts)

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self, running: bool = False) -> bool:
        return self.scheduler.reset_prefix_cache(running)

    def observe_request(self, request_id: str) -> RequestView:
        seen = self._seen.get(request_id)
        if seen is None:
            seen = self._seen[request_id] = ViewMemo()
        return self._view(self.scheduler.requests[request_id],
                          self.scheduler.kv.get_blocks(request_id), seen)

    def final_view(self, request_id: str) -> RequestView | None:
        r = self._requests.get(request_id)
        if r is None or request_id in self.scheduler.requests:
            return None
        return self._view(r, tuple([] for _ in self.config.groups), ViewMemo())

    def _view(self, r, tables, seen: ViewMemo) -> RequestView:
        """``r``'s view, holding ``tables`` (its blocks per group): the very view
        ``seen`` last time while every field is equal. Each field is read afresh
        (a mutant writes a request's fields directly); a tuple is the same
        object while its list is equal, so the fields compare by identity first."""
        tuples = seen.tuples
        fields = (r.request_id, r.status, tuples.get("prompt", r.prompt_token_ids),
                  tuples.get("output", r.output_token_ids), r.max_tokens,
                  r.num_computed_tokens, r.num_cached_tokens, r.num_external_computed_tokens,
                  r.num_preemptions,
                  tuple([tuples.get(g, blocks, _get_block_ids)
                         for g, blocks in enumerate(tables)]),
                  tuples.get("hashes", r.block_hashes), tuples.get("spec", r.spec_token_ids),
                  r.num_output_placeholders, r.priority, r.eos_token_id)
        return seen.get(fields, _make_view)

    def _observe_cached(self, pool) -> tuple:
        """The prefix cache's (hash, block id) entries, read again only when the
        pool says it changed (``cache_version``: its only writers bump it)."""
        version = getattr(pool, "cache_version", None)
        if version is None:  # a pool without the version (a mutant's own): read it all
            return tuple((h, b.block_id) for h, b in pool.get_cached_entries())
        if version != self._cached_seen[0]:
            self._cached_seen = (version, pool.get_cached_entry_ids())
        return self._cached_seen[1]

    def observe(self) -> Observation:
        s = self.scheduler
        requests = {rid: self.observe_request(rid) for rid in s.requests}
        self._seen = keep_memos_of(self._seen, requests)
        return Observation(
            config=self.config, requests=requests,
            waiting=tuple(r.request_id for r in s.waiting),
            running=tuple(r.request_id for r in s.running),
            pool=self._observe_pool(),
            sending=tuple(rid for rid, r in requests.items() if r.status.is_finished))

    def _observe_pool(self) -> PoolView:
        """Counts and free queue copied whole from the pool's own storage (C
        loops; no entry is skipped as unchanged), each the same tuple as last
        time while equal."""
        s, tuples = self.scheduler, self._pool_tuples
        pool = s.kv.pool
        return PoolView(ref_cnt=tuples.get("ref_cnt", pool.ref_cnts),
                        free_queue=tuples.get_equal("free", pool.free_queue.get_block_ids()),
                        cached=self._observe_cached(pool),
                        fenced=tuples.get_equal("fenced", s.in_flight.get_fenced_block_ids()))


#: the fields ``ImplTarget._view`` reads, in the order it reads them: the
#: first of ``RequestView``'s, which it is built of positionally (a keyword
#: call takes twice as long)
_VIEW_FIELDS = ("request_id", "status", "prompt_token_ids", "output_token_ids", "max_tokens",
                "num_computed_tokens", "num_cached_tokens", "num_external_computed_tokens",
                "num_preemptions", "block_ids", "block_hashes", "spec_token_ids",
                "num_output_placeholders", "priority", "eos_token_id")
if tuple(f.name for f in attrs.fields(RequestView))[:len(_VIEW_FIELDS)] != _VIEW_FIELDS:
    raise TypeError("RequestView's fields moved: ImplTarget._view builds it positionally")


def _make_view(fields: tuple) -> RequestView:
    return RequestView(*fields)


def make_config(block_size=4, num_blocks=16, max_num_batched_tokens=16, max_num_seqs=4,
                max_model_len=32, long_prefill_token_threshold=0, policy="fcfs",
                kv_load_failure_policy="recompute", enable_prefix_caching=True,
                async_scheduling=False, kv_role="kv_both", num_speculative_tokens=0,
                groups=None, **more) -> Config:
    """A ``Config`` of one full-attention group unless ``groups`` are given;
    ``more``: any other ``Config`` field (``kv_connector``, ``max_concurrent_batches``)."""
    return Config(groups=groups or (GroupSpec(block_size),), num_blocks=num_blocks,
                  max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                  max_model_len=max_model_len,
                  long_prefill_token_threshold=long_prefill_token_threshold, policy=policy,
                  kv_load_failure_policy=kv_load_failure_policy,
                  enable_prefix_caching=enable_prefix_caching,
                  async_scheduling=async_scheduling, kv_role=kv_role,
                  num_speculative_tokens=num_speculative_tokens, **more)
