"""Historical bugs, put back into the reference implementation one at a time.

Each mutant is a subclass of the reference ``Scheduler`` that overrides the
one method where the bug lived. Each names the invariant expected to catch it.
"""
from __future__ import annotations

import attrs

from kvspec.impl.block_pool import NULL
from kvspec.impl.kv_cache_manager import KVCacheManager
from kvspec.impl.scheduler import Scheduler
from kvspec.spec.state import STATS_UNSET, RequestStatus


@attrs.frozen
class Mutant:
    name: str
    description: str
    upstream: str
    expected_invariant: str
    cls: type
    #: other claims the bug breaks directly: which one a run meets first depends
    #: on what the fuzzer explores first
    also_caught_by: tuple[str, ...] = ()

    @property
    def catching_claims(self) -> set[str]:
        return {self.expected_invariant, *self.also_caught_by}

    def scheduler_class(self) -> type:
        return self.cls


class AsyncBlockRounding(Scheduler):
    """Pre-#34616: after an async load, count whole allocated blocks."""

    def _finish_remote_load(self, request):
        if request.request_id in self.finished_recving and \
                request.request_id not in self.failed_recving and request.num_computed_tokens:
            num_blocks = len(self.kv.get_block_ids(request.request_id)[0])
            rounded = min(num_blocks * self.block_size, request.num_tokens)
            request.num_computed_tokens = rounded
        return super()._finish_remote_load(request)


class StatsResetOnReschedule(Scheduler):
    """#36859: num_external_computed_tokens re-set on every scheduling."""

    def _record_stats_once(self, request):
        if request.num_cached_tokens == STATS_UNSET:
            return super()._record_stats_once(request)
        local, external = self._load_origin.get(request.request_id, (0, 0))
        request.num_external_computed_tokens = external


class CacheFailedBlock(Scheduler):
    """Review of #34616: a block whose load failed stays in the prefix cache."""

    def _handle_invalid_blocks(self, invalid_block_ids, released=()):
        uncache = self.kv.uncache_blocks
        self.kv.uncache_blocks = lambda ids: None
        try:
            return super()._handle_invalid_blocks(invalid_block_ids, released)
        finally:
            self.kv.uncache_blocks = uncache


class PreemptKeepsBlocks(Scheduler):
    """A preempted request keeps its blocks (preemption frees nothing)."""

    def _preempt(self, request, plan, drop_stale=True):
        free = self.kv.free
        self.kv.free = lambda req: None
        try:
            return super()._preempt(request, plan, drop_stale)  # whether fenced
        finally:
            self.kv.free = free


MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("async_block_rounding",
           "async load sets num_computed_tokens = len(blocks) * block_size (pre-#34616)",
           "#34616 (seed 000)", "no_caching_of_invalid_blocks", AsyncBlockRounding,
           also_caught_by=("computed_means_valid",)),
    Mutant("stats_reset_on_reschedule",
           "num_external_computed_tokens re-set on every re-scheduling",
           "#36859, #36533, #36755 (seed 001)", "stats_set_exactly_once", StatsResetOnReschedule),
    Mutant("cache_failed_block",
           "a block whose load failed stays in the prefix cache",
           "review of #34616 (seed 000)", "no_caching_of_invalid_blocks", CacheFailedBlock),
    Mutant("preempt_keeps_blocks",
           "a preempted request keeps its blocks",
           "seed 004 (_preempt_request)", "idle_waiting_holds_no_blocks", PreemptKeepsBlocks),
]}


class AsyncNeverSetsStats(Scheduler):
    """Pre-#34616: requests whose KV came by an async load never set num_cached_tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._async_loaded: set[str] = set()

    def _finish_remote_load(self, request):
        self._async_loaded.add(request.request_id)
        return super()._finish_remote_load(request)

    def _record_stats_once(self, request):
        if request.request_id not in self._async_loaded:
            super()._record_stats_once(request)


class EagerCachingKVCacheManager(KVCacheManager):
    """Caches a request's blocks at allocation even when asked to delay."""

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, delay_cache_blocks=False,
                       num_external_tokens=0):
        return super().allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                      new_computed_blocks, delay_cache_blocks=False,
                                      num_external_tokens=num_external_tokens)


class AsyncCachesBeforeLoad(Scheduler):
    """Review of #34616: async-load blocks cached at allocation, before the KV
    arrived, so a load that later fails leaves them cached."""

    kv_manager_class = EagerCachingKVCacheManager


class SyncRecoveryUsesCachedTokens(Scheduler):
    """Seed 003: sync-load recovery scans only up to num_cached_tokens, which is
    the first scheduling's value and stale after a preemption."""

    def _recovery_scan_limit(self, request):
        if request.status == RequestStatus.RUNNING and request.num_cached_tokens >= 0:
            return request.num_cached_tokens
        return super()._recovery_scan_limit(request)


class SharedBlockRecomputedByNone(Scheduler):
    """A request whose failed block another request claimed keeps it as computed
    and goes on without waiting for the recompute."""

    def _recover(self, request, block_id, idx, owners):
        if owners.setdefault(block_id, request.request_id) != request.request_id:
            return
        super()._recover(request, block_id, idx, owners)


class SharedBlockRecomputedByAll(Scheduler):
    """Every request holding a failed shared block recomputes it."""

    def _recover(self, request, block_id, idx, owners):
        self._truncate(request, idx * self.block_size)


class TruncatePastFirstInvalid(Scheduler):
    """Recovery keeps the first invalid block as computed (cuts after it)."""

    def _truncate(self, request, num_valid):
        super()._truncate(request, min(request.num_computed_tokens,
                                       num_valid + self.block_size))


class FreeDuringSend(Scheduler):
    """Delayed free ignored: a finished request's blocks are freed while its KV
    is still being sent."""

    def _free_request(self, request):
        super()._free_request(request)
        if request.request_id in self.requests:
            self._free_blocks(request)


MUTANTS.update({m.name: m for m in [
    Mutant("async_never_sets_stats",
           "async-loaded requests never set num_cached_tokens",
           "#34616 (seed 000)", "running_request_has_stats", AsyncNeverSetsStats),
    Mutant("async_caches_before_load",
           "async-load blocks cached at allocation, before the KV arrived",
           "review of #34616 (seed 000)", "no_caching_of_invalid_blocks", AsyncCachesBeforeLoad),
    Mutant("sync_recovery_uses_cached_tokens",
           "sync-load recovery scans up to num_cached_tokens (stale after preemption)",
           "#35223 review (seed 003)", "computed_means_valid", SyncRecoveryUsesCachedTokens,
           # under async scheduling the missed request's output in flight is kept
           also_caught_by=("update_from_output_relation", "placeholders_match_in_flight")),
    Mutant("shared_block_recomputed_by_none",
           "a failed block shared by several requests is recomputed by none of the others",
           "seed 004 (_update_requests_with_invalid_blocks)", "computed_means_valid",
           SharedBlockRecomputedByNone,
           # under async: its output in flight is dropped, its count kept
           also_caught_by=("placeholders_match_in_flight",)),
    Mutant("shared_block_recomputed_by_all",
           "a failed block shared by several requests is recomputed by all of them",
           "seed 004 (_update_requests_with_invalid_blocks)", "failed_block_recomputed_once",
           SharedBlockRecomputedByAll),
    Mutant("truncate_past_first_invalid",
           "failure recovery leaves num_computed_tokens past the first invalid block",
           "seed 004 (_update_requests_with_invalid_blocks)", "computed_means_valid",
           TruncatePastFirstInvalid,
           # under async: the output computed on the failed block is kept
           also_caught_by=("update_from_output_relation", "placeholders_match_in_flight")),
    Mutant("free_during_send",
           "a request's blocks are freed while its KV is still being sent",
           "seed 004 (_free_request, delayed free)", "send_source_intact", FreeDuringSend),
]})

class LengthCappedOneEarly(Scheduler):
    """A request is finished LENGTH_CAPPED one token before max_tokens."""

    def _stop_status(self, request):
        if request.max_tokens > 1 and request.num_output_tokens == request.max_tokens - 1:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return super()._stop_status(request)


class StoppedWithoutEos(Scheduler):
    """A request that reaches max_tokens is reported FINISHED_STOPPED, as if it
    had sampled EOS."""

    def _stop_status(self, request):
        status = super()._stop_status(request)
        if status == RequestStatus.FINISHED_LENGTH_CAPPED:
            return RequestStatus.FINISHED_STOPPED
        return status


class AbortMarksStopped(Scheduler):
    """An aborted request ends FINISHED_STOPPED instead of FINISHED_ABORTED."""

    def finish_requests(self, request_ids, status):
        if status == RequestStatus.FINISHED_ABORTED:
            status = RequestStatus.FINISHED_STOPPED
        super().finish_requests(request_ids, status)


class FinishedSendingIgnored(Scheduler):
    """finished_sending is ignored: a request held for a KV send never frees its blocks."""

    def _update_from_kv_xfer_finished(self, finished_recving, finished_sending):
        super()._update_from_kv_xfer_finished(finished_recving, ())


class AsyncLoadCountedShort(Scheduler):
    """A finished async load counts only the whole blocks it filled (rounded down)."""

    def _finish_remote_load(self, request):
        done = super()._finish_remote_load(request)
        if done and request.request_id in self._loaded:
            request.num_computed_tokens -= request.num_computed_tokens % self.block_size
        return done


MUTANTS.update({m.name: m for m in [
    Mutant("length_capped_one_early",
           "a request is finished LENGTH_CAPPED one token before max_tokens",
           "planted (review of kvspec, issue 9)", "update_from_output_relation",
           LengthCappedOneEarly),
    Mutant("stopped_without_eos",
           "a request reaching max_tokens ends FINISHED_STOPPED without EOS",
           "planted (review of kvspec, issue 9)", "update_from_output_relation",
           StoppedWithoutEos),
    Mutant("abort_marks_stopped",
           "an aborted request ends FINISHED_STOPPED",
           "planted (review of kvspec, issue 9)", "abort_relation", AbortMarksStopped),
    Mutant("finished_sending_ignored",
           "finished_sending is ignored: blocks held for a send are never freed",
           "planted (review of kvspec, issue 9)", "finished_request_releases_blocks",
           FinishedSendingIgnored),
    Mutant("async_load_counted_short",
           "a finished async load counts only whole blocks (rounded down)",
           "planted (review of kvspec, issue 9)", "transition_admitted_by_model",
           AsyncLoadCountedShort,
           # with a sliding window the short count reads blocks the load's resume point
           # gave back
           also_caught_by=("idle_waiting_holds_no_blocks", "every_group_serves_computed")),
]})

# -- async scheduling (issue 10): steps in flight, placeholders, stale output, fences --

class PlaceholderSnapshotBeforeIncrement(Scheduler):
    """#27644 review: the boundary a scheduled step exposes is read with the
    placeholder count from before the step's own increment. Modelled as the
    increment booked late: until the scheduler's next call (while the connector
    and the cache read ``num_computed_tokens - num_output_placeholders``) the
    count is the one from before this step, so the position the step samples
    counts as known."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._unbooked: dict[str, int] = {}

    def _book_increments(self) -> None:
        for rid, delta in self._unbooked.items():
            request = self.requests.get(rid)
            if request is not None:
                request.num_output_placeholders += delta
        self._unbooked = {}

    def schedule(self):
        self._book_increments()
        before = {rid: r.num_output_placeholders for rid, r in self.requests.items()}
        output = super().schedule()
        for rid in output.num_scheduled_tokens:
            request = self.requests[rid]
            self._unbooked[rid] = request.num_output_placeholders - before.get(rid, 0)
            request.num_output_placeholders = before.get(rid, 0)
        return output

    def update_from_output(self, output, runner):
        self._book_increments()
        return super().update_from_output(output, runner)

    def finish_requests(self, request_ids, status):
        self._book_increments()
        super().finish_requests(request_ids, status)

    def reset_prefix_cache(self, *args, **kwargs):
        self._book_increments()
        return super().reset_prefix_cache(*args, **kwargs)


class PreemptKeepsPlaceholders(Scheduler):
    """#48245 (root cause; vLLM before 0.28): a preemption restarts the request
    from 0 but leaves the placeholders of its step in flight, whose output is
    dropped and never gives them back."""

    def _preempt(self, request, plan, drop_stale=True):
        held = request.num_output_placeholders
        fenced = super()._preempt(request, plan, drop_stale)
        request.num_output_placeholders = held
        return fenced


class StaleOutputReturnsShare(Scheduler):
    """#47900, #48245 (and #46066 on the reset path): output made stale by a
    preemption is dropped, yet still takes its share off the placeholder count
    the preemption already zeroed."""

    def update_from_output(self, output, runner):
        if self.is_async:
            for rid in output.num_scheduled_tokens:
                request = self.requests.get(rid)
                tokens = runner.sampled_token_ids.get(rid, ())
                if request is None or request.is_finished() or not tokens:
                    continue
                if self.in_flight.stale.get(rid, 0) > 0:
                    drafts = len(output.scheduled_spec_decode_tokens.get(rid, ()))
                    self.in_flight.return_share(request, drafts, len(tokens))
        return super().update_from_output(output, runner)


class StaleOutputDelivered(Scheduler):
    """#38624, #50297 (drop mode), and the 0.32.0 finding
    async-recovery-keeps-placeholders: output in flight that a preemption or a
    recovery cut made stale is applied when it arrives, as if the request had
    kept running.
    The stale bookkeeping is kept (the count drains, the zeroed placeholders are
    not touched, as vLLM 0.28+ does for a stale frame it delivers); only the
    tokens are appended where they should have been dropped."""

    def update_from_output(self, output, runner):
        stale = [rid for rid in output.num_scheduled_tokens
                 if self.is_async and self.in_flight.stale.get(rid, 0) > 0]
        new_tokens = super().update_from_output(output, runner)
        for rid in stale:
            request = self.requests.get(rid)
            tokens = list(runner.sampled_token_ids.get(rid, []))
            if request is not None and not request.is_finished() and tokens:
                new_tokens[rid] = self._append_tokens(request, tokens)
        return new_tokens


class FreeUnderStepInFlight(Scheduler):
    """#45357 (before defer_block_free; vllm-ascend #14055): the blocks of a
    request that ends or is preempted while a step in flight still writes them
    go back to the pool at once, not when that step's output is processed."""

    def _free_or_fence(self, request):
        self.kv.free(request)
        return False


class PreemptPastFencedVictim(Scheduler):
    """#49674 (fixed by #49675; vllm-ascend #16315): the allocation retry
    assumes every preemption frees the victim's blocks at once, so after a
    victim whose blocks are fenced behind a step in flight it goes on
    preempting, down to the request itself."""

    def _preempt(self, request, plan, drop_stale=True):
        super()._preempt(request, plan, drop_stale)
        return False


class StatsResetByDroppedFirstOutput(Scheduler):
    """#36755 area (seed 001): the cache-hit stats travel with a request's first
    output, and a first output dropped as stale (the request was preempted in
    step N+1 while step N's output was in flight, or cut back by a load failure)
    re-arms them, so its next scheduling sets them again."""

    def update_from_output(self, output, runner):
        rearm = [rid for rid in output.num_scheduled_tokens
                 if self.is_async and self.in_flight.stale.get(rid, 0) > 0
                 and runner.sampled_token_ids.get(rid)
                 and rid in self.requests and not self.requests[rid].output_token_ids]
        new_tokens = super().update_from_output(output, runner)
        for rid in rearm:
            request = self.requests.get(rid)
            if request is not None and not request.is_finished() \
                    and not request.output_token_ids:
                request.num_cached_tokens = STATS_UNSET
        return new_tokens


MUTANTS.update({m.name: m for m in [
    Mutant("placeholder_snapshot_before_increment",
           "the boundary a scheduled step exposes uses the placeholder count from before "
           "the step's increment",
           "#27644 review (seed 002)", "placeholders_match_in_flight",
           PlaceholderSnapshotBeforeIncrement),
    Mutant("preempt_keeps_placeholders",
           "a preemption with output in flight restarts the request but keeps its placeholders",
           "#48245, #47900 (vLLM < 0.28)", "computed_within_tokens", PreemptKeepsPlaceholders),
    Mutant("stale_output_returns_share",
           "dropped stale output still takes its share off the placeholders a preemption zeroed",
           "#47900, #48245, #46066", "placeholders_nonnegative", StaleOutputReturnsShare,
           also_caught_by=("placeholders_match_in_flight", "computed_means_valid",
                           "every_group_serves_computed")),
    Mutant("stale_output_delivered",
           "output in flight made stale by a preemption or a recovery cut is delivered, "
           "not dropped",
           "#38624, #50297; finding 0.32.0 async-recovery-keeps-placeholders",
           "output_is_the_sampled_sequence",
           StaleOutputDelivered),
    Mutant("free_under_step_in_flight",
           "blocks of a request that ends or is preempted are freed at once while a step in "
           "flight still writes them",
           "#45357, vllm-ascend #14055", "no_caching_of_invalid_blocks",
           FreeUnderStepInFlight),
    Mutant("preempt_past_fenced_victim",
           "the preemption loop goes on after a victim whose blocks are fenced",
           "#49674 (fixed by #49675)", "preemption_stops_at_fenced_victim",
           PreemptPastFencedVictim, also_caught_by=("every_request_finishes",)),
    Mutant("stats_reset_by_dropped_first_output",
           "cache-hit stats re-armed when a request's first output is dropped as stale "
           "(preempted with it in flight), and set again",
           "#36755 area, #36859 (seed 001)", "stats_set_exactly_once",
           StatsResetByDroppedFirstOutput),
]})

class RejectionKeepsPlaceholders(Scheduler):
    """#24799 (async scheduling with spec decode; #22262 before it): the
    placeholders a step reserved cover its drafts, but rejected drafts come off
    ``num_computed_tokens`` only, so the placeholder count keeps them and the
    next step schedules positions nothing will fill."""

    def _apply_spec_rejections(self, request, output, tokens):
        super()._apply_spec_rejections(request, output, tokens)
        drafts = output.scheduled_spec_decode_tokens.get(request.request_id)
        if self.is_async and drafts and tokens:
            request.num_output_placeholders += len(drafts) - (len(tokens) - 1)


class StaleRejectionRollsBack(Scheduler):
    """#46066 (vLLM up to 0.24 on the preemption path too): the rejection
    adjustment runs before the stale check, so output made stale by a
    preemption still takes its rejected drafts off the restarted request's
    ``num_computed_tokens`` and placeholders (each only guarded by ``> 0``)."""

    def update_from_output(self, output, runner):
        for rid in output.num_scheduled_tokens:
            request = self.requests.get(rid)
            drafts = output.scheduled_spec_decode_tokens.get(rid)
            tokens = runner.sampled_token_ids.get(rid)
            if (self.is_async and request is not None and not request.is_finished()
                    and drafts and tokens and self.in_flight.stale.get(rid, 0) > 0):
                rejected = len(drafts) - (len(tokens) - 1)
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= rejected
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= rejected
        return super().update_from_output(output, runner)


class DraftCountIgnoresPlaceholders(Scheduler):
    """#24799 review: under async scheduling the positions past a request's
    tokens include the placeholders of its step in flight; counting them as
    drafts schedules every placeholder draft even when the step was cut short
    (by the token budget, the long-prefill cap or ``max_model_len``)."""

    def _schedule_spec_tokens(self, request, num_new, plan):
        num_spec = num_new + request.num_computed_tokens - request.num_tokens
        if request.spec_token_ids and num_spec > 0:
            plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
        request.spec_token_ids = []


MUTANTS.update({m.name: m for m in [
    Mutant("rejection_keeps_placeholders",
           "under async scheduling rejected drafts come off num_computed_tokens but not "
           "off the placeholders",
           "#24799, #22262", "placeholders_match_in_flight", RejectionKeepsPlaceholders),
    Mutant("stale_rejection_rolls_back",
           "output made stale by a preemption still rolls back its rejected drafts, on the "
           "restarted request",
           "#46066 (vLLM <= 0.24)", "placeholders_match_in_flight", StaleRejectionRollsBack),
    Mutant("draft_count_ignores_placeholders",
           "the drafts scheduled count the placeholder positions of the step in flight",
           "#24799", "schedule_relation", DraftCountIgnoresPlaceholders),
]})


# -- several KV cache groups (issue 11) -------------------------------------------

class HybridPerGroupAccounting(Scheduler):
    """#35223's first version (seed 003): recovery counts the affected tokens
    group by group and keeps the cut before the first failed block, as with
    one group, though a windowed group has given back the blocks the window
    behind the cut needs."""

    def _recover_from(self, request, tables, first, owners):
        if not self.kv.is_hybrid:
            return super()._recover_from(request, tables, first, owners)
        idx = first // self.block_size  # ``first``: the failed block's position
        return self._recover(request, tables[0][idx], idx, owners)


class HybridSingleGroupUnpack(Scheduler):
    """#45474: the recovery of invalid blocks unpacks the request's block ids
    as a single group; with several groups it raises."""

    def _handle_invalid_blocks(self, invalid_block_ids, released=()):
        if invalid_block_ids:  # vLLM scans the requests only when a load failed
            for request in self.running:
                (_ids,) = self.kv.get_block_ids(request.request_id)
        return super()._handle_invalid_blocks(invalid_block_ids, released)


class HitIgnoresWindowKVCacheManager(KVCacheManager):
    """Hits as group 0 alone serves them; other groups take what they cache."""

    def _get_hit(self, request, num_blocks):
        hit = self.empty_blocks()
        for g, group in enumerate(self.groups):
            for index in range(num_blocks * self.scheduler_block_size // group.block_size):
                block = self._cached(request, g, index)
                if block is None and g == 0:
                    return None
                hit[g].append(block or NULL)
        return hit


class HybridHitIgnoresWindow(Scheduler):
    """A prefix hit counted by the full-attention group alone: a windowed
    group that no longer caches the blocks the window needs gets null blocks
    there."""

    kv_manager_class = HitIgnoresWindowKVCacheManager


class LoadEndSkipKVCacheManager(KVCacheManager):
    """Windowed blocks skipped from the hit's end, as vLLM 0.32.0 does."""

    def get_resume_point(self, request, num_hit_tokens):
        return num_hit_tokens


class HybridFullPromptHitWindowFreed(Scheduler):
    """vLLM 0.32.0 (finding hybrid-full-prompt-hit-window-freed): a hit of the
    whole prompt skips the windowed blocks behind the load's end, but the
    last token is recomputed from one position earlier and reads them."""

    kv_manager_class = LoadEndSkipKVCacheManager


MUTANTS.update({m.name: m for m in [
    Mutant("hybrid_per_group_accounting",
           "recovery on a hybrid model keeps the single-group cut though a windowed group "
           "gave back the blocks its window needs there",
           "#35223 first version (seed 003)", "every_group_serves_computed",
           HybridPerGroupAccounting),
    Mutant("hybrid_single_group_unpack",
           "load-failure recovery unpacks a single group's block ids on a hybrid model: crash",
           "#45474", "target_crashed", HybridSingleGroupUnpack),
    Mutant("hybrid_hit_ignores_window",
           "a prefix hit counted by the full-attention group alone; windowed groups get null "
           "blocks where their window needs cached ones",
           "the hybrid KV cache manager's hit rule (every group serves the hit)",
           "every_group_serves_computed", HybridHitIgnoresWindow,
           also_caught_by=("no_caching_of_invalid_blocks", "update_from_output_relation",
                           "computed_means_valid")),
    Mutant("hybrid_full_prompt_hit_window_freed",
           "a full-prompt external hit skips the window behind the load's end; the recomputed "
           "last token reads blocks given back",
           "finding vllm-0.32.0-hybrid-full-prompt-hit-window-freed",
           "every_group_serves_computed", HybridFullPromptHitWindowFreed),
]})

class FullPromptHitKVCacheManager(KVCacheManager):
    """A prompt cached whole is hit whole, less its last token: the request
    recomputes only that token, wherever it lies in its block."""

    def get_computed_blocks(self, request):
        if not self.enable_caching:
            return self.empty_blocks(), 0
        size = self.scheduler_block_size
        limit = request.num_tokens // size
        for num_blocks in range(self._num_full_hit_blocks(request, limit), 0, -1):
            hit = self._get_hit(request, num_blocks)
            if hit is not None:
                return hit, min(num_blocks * size, request.num_tokens - 1)
        return self.empty_blocks(), 0


class MambaResumeMidBlock(Scheduler):
    """The audit of finding hybrid-full-prompt-hit-window-freed: a request whose
    whole prompt of ``n`` tokens is cached resumes at ``n - 1`` to recompute its
    last token, as attention alone allows. An align-mode Mamba block holds one
    state, the state after the last position written into it, so when
    positions ``n - 2`` and ``n - 1`` share a block the step from ``n - 1``
    reads the state after ``n`` tokens as the state after ``n - 1``. (vLLM caps
    a local hit at the last whole block below the last token; the in-tree
    connectors back a hit off by one token when there is a Mamba group.)"""

    kv_manager_class = FullPromptHitKVCacheManager


MUTANTS.update({m.name: m for m in [
    Mutant("mamba_resume_mid_block",
           "a prompt cached whole resumes at its last token mid-block; with a last-state "
           "group that block holds the state after the whole prompt, read as the state one "
           "token earlier",
           "the audit of finding vllm-0.32.0-hybrid-full-prompt-hit-window-freed (an "
           "align-mode Mamba block holds one state, so a recompute from n - 1 reads "
           "h(n) as h(n - 1))",
           "computed_means_valid", MambaResumeMidBlock,
           # with a sliding window too, the window block the hit left out
           also_caught_by=("update_from_output_relation", "transition_admitted_by_model",
                           "no_caching_of_invalid_blocks", "every_group_serves_computed")),
]})

# -- what the scheduler output tells the worker -------------------------------------

class ResumedTableNotReset(Scheduler):
    """#26661: a resumed request's blocks are told as if it had kept running
    (only those past what the worker knew before the preemption), so the table
    the worker rebuilds for it holds no block where its step computes."""

    def _blocks_to_send(self, req_id, whole):
        resumed = whole and req_id in self._told
        return super()._blocks_to_send(req_id, whole and not resumed)


MUTANTS.update({m.name: m for m in [
    Mutant("resumed_table_not_reset",
           "a resumed request's output carries only the blocks past what the worker knew "
           "before the preemption, not its whole new table",
           "#26661 (a preempted request's block table not reset in the worker)",
           "worker_tables_match_scheduler", ResumedTableNotReset),
]})

class PlainHashKVCacheManager(KVCacheManager):
    """Every group's blocks cached under the block's plain hash: the key of the
    first group, so a windowed group's copy never enters the cache (the hash is
    taken) and its lookups, keyed by group, never hit."""

    def cache_block(self, block, block_hash, group: int) -> None:
        if block_hash not in self.pool.cached:
            self.pool.cache_block(block, block_hash)


class HybridCacheUnderPlainHash(Scheduler):
    """Issue 25: hybrid blocks cached under the plain hash. With one block size
    nothing is corrupted (no block is served under a key naming other content);
    local prefix hits of multi-group requests vanish, and every safety claim
    holds. With two, a window block and a full-attention block ending at the
    same position share the plain hash, and one is served as the other."""

    kv_manager_class = PlainHashKVCacheManager


MUTANTS.update({m.name: m for m in [
    Mutant("hybrid_cache_under_plain_hash",
           "every KV cache group's blocks cached under the plain block hash: a windowed "
           "group's blocks never enter the prefix cache, so hybrid prefix hits are lost",
           "issue 25 (local hits of multi-group requests 439 -> 7 in 30 s, every claim held)",
           "computed_blocks_are_cached", HybridCacheUnderPlainHash,
           # with two block sizes a window block under the plain hash names the same
           # prefix end as a full-attention block: it is served as one
           also_caught_by=("no_caching_of_invalid_blocks", "computed_means_valid")),
]})

# -- two block sizes (issue 26) ----------------------------------------------------

class FullAttentionAlignedKVCacheManager(KVCacheManager):
    """Hits end, and blocks are cached, on the full-attention group's block
    boundaries, not on the least common multiple of the groups' sizes."""

    def __init__(self, groups, num_blocks, enable_caching=True):
        super().__init__(groups, num_blocks, enable_caching)
        self.scheduler_block_size = self.block_size


class HitAlignedToFullAttention(Scheduler):
    """With a sliding window whose blocks are larger than full attention's, a
    hit ending inside a window block: the window group's block there is fresh
    and the step reads positions of it nobody computed."""

    kv_manager_class = FullAttentionAlignedKVCacheManager


MUTANTS.update({m.name: m for m in [
    Mutant("hit_aligned_to_full_attention",
           "with two block sizes, prefix hits end on the full-attention group's block "
           "boundaries, inside a larger window block whose start nobody computed",
           "vLLM's scheduler_block_size (least common multiple of the groups' sizes)",
           "no_caching_of_invalid_blocks", HitAlignedToFullAttention,
           also_caught_by=("update_from_output_relation", "computed_means_valid",
                           "every_group_serves_computed")),
]})

#: mutants that need spec features not built yet: listed so the zoo table shows
#: them as pending.
PENDING_MUTANTS: dict[str, tuple[str, str]] = {}

#: bugs the conformance model sees too, since it judges async steps (issue 25):
#: a schedule or an output no shape of spec/effects.py admits. Which claim a run
#: meets first depends on where shrinking ends.
SEEN_BY_THE_MODEL = ("async_block_rounding", "placeholder_snapshot_before_increment",
                     "preempt_keeps_placeholders", "stale_output_returns_share",
                     "stale_output_delivered", "rejection_keeps_placeholders",
                     "stale_rejection_rolls_back", "draft_count_ignores_placeholders",
                     "stats_reset_by_dropped_first_output")
for _name in SEEN_BY_THE_MODEL:
    MUTANTS[_name] = attrs.evolve(MUTANTS[_name], also_caught_by=(
        *MUTANTS[_name].also_caught_by, "transition_admitted_by_model"))
