"""The reference scheduler.

``schedule()`` reads like its table of contents: running requests first
(preempting when the pool is full), then waiting ones (prefix hits, external
loads), then the output. ``update_from_output()`` applies the worker's report:
failed loads first, then sampled tokens and stops, then finished transfers.
"""
from __future__ import annotations

import attrs

from kvspec.impl.config import SchedulerConfig
from kvspec.impl.connector import KVConnector, NoConnector, check_matched_tokens
from kvspec.impl.in_flight import FencedTables, InFlightBook
from kvspec.impl.kv_cache_manager import KVCacheManager
from kvspec.impl.outputs import ModelRunnerOutput, SchedulerOutput
from kvspec.impl.recovery import RecoveryBook, Waiter, first_invalid_index, lower_stats
from kvspec.impl.request import Request
from kvspec.impl.request_queue import RequestQueue
from kvspec.spec.arith import compute_truncated_computed
from kvspec.spec.groups import get_blocks_from, get_first_failed_position
from kvspec.spec.state import STATS_UNSET, RequestStatus


@attrs.define
class StepPlan:
    """What one ``schedule()`` call has decided so far."""

    budget: int
    num_scheduled_tokens: dict[str, int] = attrs.Factory(dict)
    num_computed_before: dict[str, int] = attrs.Factory(dict)
    spec_tokens: dict[str, list[int]] = attrs.Factory(dict)
    new_reqs: list[Request] = attrs.Factory(list)
    resumed_reqs: list[Request] = attrs.Factory(list)
    running_reqs: list[Request] = attrs.Factory(list)
    preempted: list[Request] = attrs.Factory(list)
    #: a running request waits for blocks freed under steps in flight: what
    #: they give back is its, not a waiting request's
    waits_for_fences: bool = False

    def add(self, request: Request, num_tokens: int, start: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.num_computed_before[request.request_id] = start
        self.budget -= num_tokens

    def drop(self, request: Request) -> None:
        self.budget += self.num_scheduled_tokens.pop(request.request_id, 0)
        self.num_computed_before.pop(request.request_id, None)
        self.spec_tokens.pop(request.request_id, None)
        if request in self.running_reqs:
            self.running_reqs.remove(request)


class Scheduler:
    #: the KV cache manager it builds (a mutant may swap it)
    kv_manager_class = KVCacheManager

    def __init__(self, config: SchedulerConfig, connector: KVConnector | None = None) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"Scheduler needs a kvspec.impl.SchedulerConfig, got "
                            f"{type(config).__name__} {config!r:.60}")
        self.config = config
        self.connector = connector or NoConnector()
        self.kv = self.kv_manager_class(config.groups, config.num_blocks,
                                        config.enable_prefix_caching)
        self.kv.release_skipped = self._release_skipped
        self.kv.get_skip_base = self._get_skip_base
        self.block_size = config.block_size
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.recovery = RecoveryBook()
        self._load_origin: dict[str, tuple[int, int]] = {}  # req -> (local, external)
        self._loaded: set[str] = set()  # async load finished; do not ask the connector again
        self._arrivals = 0
        #: per request, how many blocks per group the worker has been told of
        self._told: dict[str, tuple[int, ...]] = {}
        #: async scheduling: placeholders, stale output and fenced frees
        self.in_flight = InFlightBook()

    @property
    def is_async(self) -> bool:
        return self.config.async_scheduling

    # ------------------------------------------------------------------
    # add / finish
    # ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._validate_new_request(request)
        self._arrivals += 1
        request.arrival_time = float(self._arrivals)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _validate_new_request(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"add_request needs a kvspec.impl.Request, got "
                            f"{type(request).__name__} {request!r:.60}")
        size = self.kv.hash_block_size
        if request.hash_block_size != size:
            # its block hashes would cover other token spans than the pool's blocks:
            # a cached block would be matched by a request with different tokens
            raise ValueError(f"request {request.request_id!r:.40}: hash_block_size "
                             f"{request.hash_block_size} differs from the scheduler's hash "
                             f"block size {size}; build it with "
                             f"Request(..., hash_block_size={size})")
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be >= 1, "
                             f"got {request.max_tokens}")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(f"request {request.request_id!r}: prompt of "
                             f"{request.num_prompt_tokens} tokens leaves no room under "
                             f"max_model_len={self.config.max_model_len}")

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        if not isinstance(status, RequestStatus):
            raise TypeError(f"finish_requests needs a RequestStatus, got {status!r:.60}")
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif request_ids is None or not hasattr(request_ids, "__iter__"):
            raise TypeError(f"finish_requests needs a request id or an iterable of ids, got "
                            f"{request_ids!r:.60}")
        for req_id in list(request_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            self._remove_from_queues(request)
            request.status = status
            self._free_request(request)

    def _remove_from_queues(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _free_request(self, request: Request) -> None:
        assert request.is_finished()
        self.finished_req_ids.add(request.request_id)
        self._release_claims(request)
        self.finished_recving.discard(request.request_id)
        self.failed_recving.discard(request.request_id)
        delay, _ = self.connector.request_finished(
            request, self.kv.get_block_ids(request.request_id))
        if not delay:
            self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        self._free_or_fence(request)
        self.in_flight.forget(request.request_id)
        self._load_origin.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        self._told.pop(request.request_id, None)
        del self.requests[request.request_id]

    def _free_or_fence(self, request: Request) -> bool:
        """Free the request's blocks, or, while a step in flight may still write
        them, hold them until its output is back. Returns whether they are fenced."""
        if not self._is_fenced(request):
            self.kv.free(request)
            return False
        tables = self.kv.get_block_ids(request.request_id)
        self.in_flight.fence(request.request_id, self.kv.pop_blocks(request), tables)
        return True

    def _is_fenced(self, request: Request) -> bool:
        """Blocks the request gives back now wait for its step in flight: a
        consumer connector's load into them would race that step."""
        return (self.is_async and self.config.is_kv_consumer
                and self.in_flight.is_in_flight(request.request_id))

    def _get_skip_base(self, request: Request, num_computed: int) -> int:
        """Windowed groups free behind the real boundary (drafts a step in
        flight may reject are read again), and behind where the oldest step in
        flight started: a load failure it reports must still find the blocks it
        read in the request's table."""
        base = num_computed - request.num_output_placeholders
        oldest = self.in_flight.get_oldest_start(request.request_id)
        return base if oldest is None else min(base, oldest)

    def _release_skipped(self, request: Request, blocks: list) -> None:
        """Blocks a windowed group gave back: a step in flight may still read
        them, so under a consumer connector they wait for its output like any
        other free (a load into them would race that read)."""
        if self._is_fenced(request):
            self.in_flight.fence(request.request_id, blocks)
        else:
            self.kv.free_blocks(blocks)

    def _release_claims(self, request: Request) -> None:
        """A leaving request stops waiting; its waiters see one holder fewer."""
        self.recovery.forget(request.request_id)

    # ------------------------------------------------------------------
    # schedule
    # ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        self._collect_finished_loads()
        self._schedule_running(plan)
        if not plan.preempted and not plan.waits_for_fences:
            self._schedule_waiting(plan)
        output = self._make_output(plan)
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        if self.is_async:
            self.in_flight.on_schedule(self.requests, plan.num_scheduled_tokens, plan.spec_tokens,
                                       self.config.num_speculative_tokens)
        self._advance_computed(plan)
        return output

    # -- running -----------------------------------------------------------
    def _schedule_running(self, plan: StepPlan) -> None:
        idx = 0
        while idx < len(self.running) and plan.budget > 0:
            request = self.running[idx]
            idx += 1
            if not self._is_ready_after_recovery(request):
                continue
            num_new = self._num_new_running_tokens(request, plan.budget)
            if num_new <= 0:
                continue
            if not self._allocate_or_preempt(request, num_new, plan):
                break
            idx = self.running.index(request) + 1
            plan.running_reqs.append(request)
            plan.add(request, num_new, request.num_computed_tokens)
            self._schedule_spec_tokens(request, num_new, plan)

    def _num_new_running_tokens(self, request: Request, budget: int) -> int:
        if self._is_output_complete_in_flight(request):
            return 0
        num_new = (request.num_tokens_with_spec + request.num_output_placeholders
                   - request.num_computed_tokens)
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        num_new = min(num_new, budget)
        # Never run a position at or past max_model_len (spec decode can ask).
        return min(num_new, self.config.max_model_len - 1 - request.num_computed_tokens)

    def _is_output_complete_in_flight(self, request: Request) -> bool:
        """Async scheduling: the step in flight samples its last token. It
        samples at least one (however many of its drafts are rejected), and
        only one step is in flight when the next is scheduled."""
        return (request.num_output_placeholders > 0
                and request.num_output_tokens + 1 >= request.max_tokens)

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self._pick_victim()
            if victim is request and self._release_loaded_waiting():
                continue  # loaded-but-waiting KV gave way before the request preempts itself
            if victim is request and self.in_flight.fenced:
                # blocks freed under steps in flight come back within the queue's
                # depth: wait for them. Preempting itself instead, with three or
                # more steps in flight, lets two requests that each need most of
                # the pool preempt one another forever (a livelock). Waiting
                # requests do not run meanwhile: the ones it preempted would
                # resume on hits of their own fenced blocks and take the rest,
                # again and again (model_tests/impl_regressions/async_drafts_fenced_livelock)
                plan.waits_for_fences = True
                return False
            if victim is request and self.is_async and self._is_loading_elsewhere():
                # wait for that load instead: its output arrives a step late under
                # async scheduling, and a self-preempted request that reloads
                # would take the blocks the loaded one needs next (a livelock)
                return False
            fenced = self._preempt(victim, plan, drop_stale=self.config.requires_kv_delivery)
            if victim is request:
                return False
            if fenced:
                # its blocks come back once the step in flight is processed:
                # preempting more now would free nothing sooner (#49674)
                return False
        return True

    def _is_loading_elsewhere(self) -> bool:
        """Some waiting request holds blocks an async load is filling; once it
        lands they can be released (``_release_loaded_waiting``)."""
        return any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                   and any(self.kv.get_block_ids(r.request_id)) for r in self.waiting)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, plan: StepPlan, drop_stale: bool = True) -> bool:
        """Returns whether its blocks were fenced (a step in flight writes them).
        ``drop_stale``: its output in flight is dropped, not delivered."""
        assert request.status == RequestStatus.RUNNING, "only running requests are preempted"
        self.running.remove(request)
        plan.drop(request)
        self._release_claims(request)
        # Blocks cached past the computed prefix (by this step's allocation, or a
        # sync load that will now never run) hold no KV yet: do not serve them.
        self.kv.uncache_blocks(get_blocks_from(self.config.groups,
                                               self.kv.get_block_ids(request.request_id),
                                               request.num_computed_tokens))
        fenced = self._free_or_fence(request)
        self._load_origin.pop(request.request_id, None)
        if self.is_async:
            self.in_flight.make_stale(request, drop_stale)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.prepend(request)
        plan.preempted.append(request)
        return fenced

    def _schedule_spec_tokens(self, request: Request, num_new: int, plan: StepPlan) -> None:
        """The positions past its known tokens (and the placeholders of the step
        in flight) are drafts."""
        num_spec = (num_new + request.num_computed_tokens - request.num_tokens
                    - request.num_output_placeholders)
        if request.spec_token_ids and num_spec > 0:
            plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
        request.spec_token_ids = []

    def _is_ready_after_recovery(self, request: Request) -> bool:
        """A waiter runs again once no running holder is still recomputing its
        next block; it resumes over every leading block a holder recomputed."""
        waiter = self.recovery.waiters.get(request.request_id)
        if waiter is None:
            return True
        (table, *_) = self.kv.get_block_ids(request.request_id)
        idx = request.num_computed_tokens // self.block_size
        limit_blocks = min(len(table), -(-waiter.limit // self.block_size))
        while idx < limit_blocks and self._holder_computed(table[idx], idx, request):
            idx += 1
        if idx < limit_blocks and self._holder_computing(table[idx], idx, request):
            return False
        del self.recovery.waiters[request.request_id]
        request.num_computed_tokens = max(request.num_computed_tokens,
                                          min(waiter.limit, idx * self.block_size))
        return True

    def _running_holders(self, block_id: int, idx: int, me: Request):
        for other in self.running:
            if other is me or other.request_id in self.recovery.waiters:
                continue
            (table, *_) = self.kv.get_block_ids(other.request_id)
            if idx < len(table) and table[idx] == block_id:
                yield other

    def _holder_computed(self, block_id: int, idx: int, me: Request) -> bool:
        end = (idx + 1) * self.block_size
        return any(o.num_computed_tokens >= end for o in self._running_holders(block_id, idx, me))

    def _holder_computing(self, block_id: int, idx: int, me: Request) -> bool:
        end = (idx + 1) * self.block_size
        return any(o.num_computed_tokens < end for o in self._running_holders(block_id, idx, me))

    # -- waiting -----------------------------------------------------------
    def _schedule_waiting(self, plan: StepPlan) -> None:
        skipped: list[Request] = []
        blocked = False
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.pop()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS or \
                    self.in_flight.has_deliverable_stale(request.request_id):
                # finished loads left this status at the top of schedule(); a
                # preempted request waits for the stale output it will be given
                skipped.append(request)
                continue
            # Past a blocked head only requests that already hold their KV may
            # go: they need little and free what they hold when they finish.
            if blocked and request.request_id not in self._loaded:
                skipped.append(request)
                continue
            outcome = self._try_schedule_waiting(request, plan)
            blocked = blocked or outcome == "blocked"
            if outcome != "scheduled":
                skipped.append(request)
        self.waiting.prepend_all(skipped)
        if blocked and not self.running:
            self._release_loaded_waiting()

    def _release_loaded_waiting(self) -> bool:
        """Memory is needed and nothing else can give: loaded-but-waiting
        requests give their blocks back and will recompute without asking the
        connector again (asking could park them on a new load and loop), so the
        pool, sized for one request of max_model_len, always lets one through.
        Returns whether any block was released."""
        released = False
        for request in self.waiting:
            if request.request_id in self._loaded and any(self.kv.get_block_ids(request.request_id)):
                self.kv.free(request)
                self._load_origin[request.request_id] = (0, 0)
                request.num_computed_tokens = 0
                released = True
        return released

    def _collect_finished_loads(self) -> None:
        """Loads reported finished leave WAITING_FOR_REMOTE_KVS at once, so their
        blocks count as releasable even when the waiting queue is not reached."""
        for request in list(self.waiting):
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._finish_remote_load(request)

    def _try_schedule_waiting(self, request: Request, plan: StepPlan) -> str:
        if request.request_id not in self._loaded:
            hit = self._find_hits(request)
            if hit is None:
                return "skip"  # the connector cannot answer yet
            local_blocks, num_local, num_external, load_async = hit
        else:  # an async load already finished: its blocks are held
            if not self._is_ready_after_recovery(request):
                return "skip"
            local_blocks, num_local, num_external, load_async = None, 0, 0, False
        computed = request.num_computed_tokens + num_local + num_external
        if load_async:
            num_new = 0
        else:
            computed = min(computed, request.num_tokens - 1)  # compute >= 1 token
            num_new = self._clip_new_tokens(request.num_tokens - computed, plan.budget)
        new_blocks = self.kv.allocate_slots(
            request, num_new + computed - request.num_computed_tokens - num_local,
            num_local, local_blocks, delay_cache_blocks=load_async,
            num_external_tokens=num_external)
        if new_blocks is None:
            return "blocked"
        if request.request_id not in self._loaded:
            self._load_origin[request.request_id] = (num_local, num_external)
            self.connector.update_state_after_alloc(
                request, self.kv.get_block_ids(request.request_id), num_external)
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            # #34616: the target is local + external hits, not a block multiple.
            request.num_computed_tokens = computed
            return "loading"
        self._start_running(request, computed, num_new, plan)
        return "scheduled"

    def _find_hits(self, request: Request):
        local_blocks, num_local = self.kv.get_computed_blocks(request)
        answer = self.connector.get_num_new_matched_tokens(request, num_local)
        check_matched_tokens(request, num_local, answer)
        num_external, load_async = answer
        if num_external is None:
            return None
        return local_blocks, num_local, num_external, load_async and num_external > 0

    def _clip_new_tokens(self, num_new: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        return min(num_new, budget)

    def _start_running(self, request: Request, computed: int, num_new: int,
                       plan: StepPlan) -> None:
        was_preempted = request.status == RequestStatus.PREEMPTED
        self._loaded.discard(request.request_id)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = computed
        self._record_stats_once(request)
        self.running.append(request)
        (plan.resumed_reqs if was_preempted else plan.new_reqs).append(request)
        plan.add(request, num_new, computed)

    def _record_stats_once(self, request: Request) -> None:
        """Cache-hit stats describe the first scheduling only (#36859, #37460)."""
        if request.num_cached_tokens != STATS_UNSET:
            return
        local, external = self._load_origin.get(request.request_id, (0, 0))
        request.num_cached_tokens = request.num_computed_tokens
        request.num_external_computed_tokens = max(
            0, min(external, request.num_computed_tokens - local))

    def _finish_remote_load(self, request: Request) -> bool:
        """WAITING_FOR_REMOTE_KVS -> WAITING once the load is reported done."""
        req_id = request.request_id
        if req_id not in self.finished_recving:
            return False
        self.finished_recving.discard(req_id)
        self.failed_recving.discard(req_id)
        if request.num_computed_tokens == 0:
            self.kv.free(request)  # nothing valid arrived; a retry may hit locally
            self._load_origin.pop(req_id, None)
            return self._back_to_waiting(request)
        self._loaded.add(req_id)
        # Full-prompt hit: the last token is recomputed to sample from it.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == 0:  # a one-token prompt: nothing to keep
            self.kv.free(request)
        return self._back_to_waiting(request)

    def _back_to_waiting(self, request: Request) -> bool:
        request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                          else RequestStatus.WAITING)
        return True

    # -- output ------------------------------------------------------------
    def _make_output(self, plan: StepPlan) -> SchedulerOutput:
        scheduled = plan.num_scheduled_tokens
        output = SchedulerOutput(
            num_scheduled_tokens=dict(scheduled),
            num_computed_before=dict(plan.num_computed_before),
            scheduled_spec_decode_tokens={k: list(v) for k, v in plan.spec_tokens.items()},
            new_req_ids=[r.request_id for r in plan.new_reqs],
            resumed_req_ids=[r.request_id for r in plan.resumed_reqs],
            preempted_req_ids={r.request_id for r in plan.preempted},
            finished_req_ids=self.finished_req_ids,
            block_ids={rid: self.kv.get_block_ids(rid) for rid in scheduled})
        whole = {r.request_id for r in (*plan.new_reqs, *plan.resumed_reqs)}
        output.new_block_ids = {rid: self._blocks_to_send(rid, rid in whole) for rid in scheduled}
        self.finished_req_ids = set()
        return output

    def _blocks_to_send(self, req_id: str, whole: bool):
        """What the output tells the worker of a request's blocks: the whole
        table for a new or resumed request, else the blocks allocated since it
        was last told (None: none)."""
        tables = self.kv.get_block_ids(req_id)
        told = None if whole else self._told.get(req_id)
        self._told[req_id] = tuple(len(t) for t in tables)
        if told is None:
            return tuple(tuple(t) for t in tables)
        new = tuple(tuple(t[n:]) for t, n in zip(tables, told))
        return new if any(new) else None

    def _advance_computed(self, plan: StepPlan) -> None:
        for req_id, num in plan.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num

    # ------------------------------------------------------------------
    # update_from_output
    # ------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput,
                           runner: ModelRunnerOutput) -> dict[str, list[int]]:
        kv_out = runner.kv_connector_output
        released = self.in_flight.on_output() if self.is_async else []
        skipped = self._handle_invalid_blocks(kv_out.invalid_block_ids, released)
        for blocks in released:
            self.kv.free_blocks(blocks)
        new_tokens: dict[str, list[int]] = {}
        for req_id in output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if req_id in skipped:
                continue  # computed on failed KV: dropped
            stale = self.in_flight.take_stale(req_id)
            if stale == "drop":
                continue  # computed before a preemption: sampled again
            tokens = list(runner.sampled_token_ids.get(req_id, []))
            if stale == "deliver":  # appended; the preemption rolled back already
                new_tokens[req_id] = self._append_tokens(request, tokens)
                continue
            self._apply_spec_rejections(request, output, tokens)
            if self.is_async and tokens:
                drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
                self.in_flight.return_share(request, drafts, len(tokens))
            new_tokens[req_id] = self._append_tokens(request, tokens)
        self._update_from_kv_xfer_finished(kv_out.finished_recving, kv_out.finished_sending)
        return new_tokens

    def _apply_spec_rejections(self, request: Request, output: SchedulerOutput,
                               tokens: list[int]) -> None:
        drafts = output.scheduled_spec_decode_tokens.get(request.request_id)
        if not drafts:
            return
        num_accepted = max(0, len(tokens) - 1)
        request.num_computed_tokens -= len(drafts) - num_accepted

    def _append_tokens(self, request: Request, tokens: list[int]) -> list[int]:
        appended = []
        for token in tokens:
            request.append_output_token_ids(token)
            appended.append(token)
            status = self._stop_status(request)
            if status is not None:
                self._remove_from_queues(request)
                request.status = status
                self._free_request(request)
                break
        return appended

    def _stop_status(self, request: Request) -> RequestStatus | None:
        if request.eos_token_id is not None and request.output_token_ids[-1] == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens \
                or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _update_from_kv_xfer_finished(self, finished_recving, finished_sending) -> None:
        for req_id in sorted(finished_recving or ()):
            if req_id in self.requests and not self.requests[req_id].is_finished():
                self.finished_recving.add(req_id)
        for req_id in sorted(finished_sending or ()):  # one order, whatever the hash seed
            request = self.requests.get(req_id)
            if request is not None and request.is_finished():
                self._free_blocks(request)

    # -- failure recovery --------------------------------------------------
    def _handle_invalid_blocks(self, invalid_block_ids, released=()) -> set[str]:
        """Returns the running requests whose output this step is discarded.
        ``released``: blocks fenced behind this step, free now: those of
        requests gone while it was in flight (``FencedTables``, with their
        tables), whose blocks past a failed one are suspect too, and those a
        windowed group gave back."""
        invalid = set(invalid_block_ids or ())
        if not invalid:
            return set()
        loading = [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        # requests that ended while the step was in flight (held for a send), and
        # those gone since (their blocks fenced until now)
        ended = [self.kv.get_block_ids(rid) for rid, r in self.requests.items()
                 if r.is_finished()]
        # ... and those gone with a later step still in flight (3 or more steps
        # in flight): what they computed in this step on the failed KV is still
        # cached, though their blocks come back only later
        still_fenced = [b for _, b in self.in_flight.fenced if isinstance(b, FencedTables)]
        released = [*released, *still_fenced]
        gone = [blocks.tables for blocks in released if isinstance(blocks, FencedTables)]
        if self.kv.is_hybrid:
            invalid = self._get_tainted(invalid, self.running + loading, ended + gone)
        suspect, owners = set(invalid), {}
        # running requests first: they own the failed blocks (impl/recovery.py)
        affected_running = self._truncate_affected(self.running, invalid, suspect, owners)
        affected_loads = self._truncate_affected(loading, invalid, suspect, owners)
        if not self.kv.is_hybrid:  # with several groups the taint closed over them
            self._suspect_ended(ended, released, invalid, suspect)
        self.failed_recving |= affected_loads
        if self.is_async:  # their output in flight was computed on the failed KV
            for req_id in affected_running:
                self.in_flight.make_stale(self.requests[req_id])
        # Blocks past a failed one were computed on top of it: none may be served.
        self.kv.uncache_blocks(suspect)
        if self.config.kv_load_failure_policy == "fail":
            self.finish_requests(affected_loads | affected_running, RequestStatus.FINISHED_ERROR)
        return affected_running

    def _suspect_ended(self, ended, released, invalid: set[int], suspect: set[int]) -> None:
        """One group: blocks of requests that ended or went while the step was
        in flight, past a failed one, are suspect too."""
        for ids in [[b.block_id for b in blocks] for blocks in released] + [
                table for tables in ended for table in tables]:
            idx = first_invalid_index(ids, len(ids) * self.block_size, self.block_size, invalid)
            if idx is not None:
                suspect.update(ids[idx:])

    def _get_tainted(self, invalid: set[int], requests, gone) -> set[int]:
        """With several kinds of group a request may read a failed block's
        garbage without holding the block: through a block of another group a
        holder computed on top of it in the failing step and shared (a hit).
        Every block computed past a failed one, in any group, and every block
        computed past those, to a fixed point, counts as failed
        (``compute_tainted_blocks``). ``gone``: block tables of requests that
        ended or went while the step was in flight, read whole. Blocks a
        windowed group gave back were behind the oldest step in flight: no
        failure it reports lies before them."""
        bad = set(invalid)
        while True:
            before = len(bad)
            for request in requests:
                tables = self.kv.get_block_ids(request.request_id)
                first = self._first_failed(request, tables, bad)
                if first is not None:
                    bad |= get_blocks_from(self.config.groups, tables, first)
            for tables in gone:  # by position, every block they held
                first = get_first_failed_position(self.config.groups, tables,
                                                  self._table_tokens(tables), bad)
                if first is not None:
                    bad |= get_blocks_from(self.config.groups, tables, first)
            if len(bad) == before:
                return bad

    def _table_tokens(self, tables) -> int:
        """Tokens the longest of a request's tables has room for."""
        return max((len(t) * g.block_size for g, t in zip(self.config.groups, tables)),
                   default=0)

    def _truncate_affected(self, requests, invalid: set[int], suspect: set[int],
                           owners: dict) -> set[str]:
        affected = set()
        for request in list(requests):
            tables = self.kv.get_block_ids(request.request_id)
            first = self._first_failed(request, tables, invalid)
            if first is None:
                continue
            affected.add(request.request_id)
            # Blocks past a failed one were computed on top of it in the failing
            # step, in every group (each layer reads the one before it).
            suspect |= get_blocks_from(self.config.groups, tables, first)
            # and so were blocks a windowed group gave back since (they left its
            # table but keep their hash): dropping a hash costs a hit at most
            suspect.update(self.kv.get_windowed_cached_ids(request, first))
            self._recover_from(request, tables, first, owners)
        return affected

    def _recover_from(self, request: Request, tables, first: int, owners: dict) -> None:
        """Recompute from the failed block at position ``first``, or from zero in fresh
        blocks: where a windowed group gave blocks back
        (``compute_recovered_computed``), or where a request that ended holds a
        block from there on for a KV send (recomputing in place would rewrite
        what is being sent)."""
        if self.kv.is_hybrid or self._is_sending_from(tables, first):
            self._restart_from_zero(request)
        else:
            idx = first // self.block_size
            self._recover(request, tables[0][idx], idx, owners)

    def _first_failed(self, request: Request, tables, bad: set[int]) -> int | None:
        """Position where the first block, in any group, under the request's
        scan limit that is in ``bad`` starts (groups share positions, so every
        group's table is cut there)."""
        return get_first_failed_position(self.config.groups, tables,
                                         self._recovery_scan_limit(request), bad)

    def _is_sending_from(self, tables, first: int) -> bool:
        """Some block holding position ``first`` or later is held by a request
        that ended and keeps its blocks for a send."""
        mine = get_blocks_from(self.config.groups, tables, first)
        return any(mine & {b for t in self.kv.get_block_ids(rid) for b in t}
                   for rid, r in self.requests.items() if r.is_finished())

    def _restart_from_zero(self, request: Request) -> None:
        """Recovery in fresh blocks. With several kinds of group (seed 003,
        #35223) a windowed group has given back the blocks behind its window,
        so no shorter prefix can be served (``compute_recovered_computed``
        admits the cut only where every group serves it; the reference always
        takes zero); with one group, when a block from the cut on is being sent.
        The request gives its blocks back and recomputes from the start: no
        block another request holds is written twice, and nobody waits on
        another's recompute across groups."""
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._free_or_fence(request)  # a loader's blocks wait for its load's report
        self._truncate(request, 0)

    def _recovery_scan_limit(self, request: Request) -> int:
        """Tokens whose blocks may hold failed external KV: all computed ones up
        to the real boundary. Under async scheduling the positions past it
        belong to steps scheduled after the failing one, in blocks that may be
        fresh (a freed block whose id a failed load reported): cutting there
        would drop the output in flight and leave nothing to recompute."""
        return request.num_computed_tokens - request.num_output_placeholders

    def _recover(self, request: Request, block_id: int, idx: int, owners: dict) -> None:
        """The first running request to meet a failed block recomputes it; later
        ones wait, and so does every async loader (impl/recovery.py)."""
        owner = owners.setdefault(block_id, request.request_id)
        if owner != request.request_id or request.status != RequestStatus.RUNNING:
            self.recovery.waiters[request.request_id] = Waiter(block_id,
                                                               request.num_computed_tokens)
        self._truncate(request, compute_truncated_computed(idx, self.block_size,
                                                           request.num_computed_tokens))

    def _truncate(self, request: Request, num_valid: int) -> None:
        request.num_computed_tokens = num_valid
        lower_stats(request, num_valid)

    # ------------------------------------------------------------------
    # misc
    # ------------------------------------------------------------------
    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        for req_id, tokens in drafts.items():
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = list(tokens)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Empty the prefix cache; only with every block free, unless forced
        (``reset_running_requests``, as after a weight update): then every
        running request is preempted first (its output in flight turns stale),
        and the hashes go even from blocks still held, fenced behind a step in
        flight or by a load: dropping a hash only costs a later hit."""
        if not reset_running_requests:
            return self.kv.reset_prefix_cache()
        plan = StepPlan(budget=0)  # outside schedule(): nothing is scheduled
        for request in reversed(list(self.running)):
            self._preempt(request, plan)
        if not self.kv.reset_prefix_cache():
            self.kv.uncache_blocks(self.kv.pool.cached_block_ids())
        return True
