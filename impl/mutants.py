"""Historical bugs, put back into the reference implementation one at a time.

Each mutant is a subclass of the reference ``Scheduler`` that overrides the
one method where the bug lived. Each names the invariant expected to catch it.
"""
from __future__ import annotations

import attrs

from kvspec.impl.recovery import RecoveryBook
from kvspec.impl.scheduler import Scheduler
from kvspec.spec.state import STATS_UNSET, RequestStatus


@attrs.frozen
class Mutant:
    name: str
    description: str
    upstream: str
    expected_invariant: str
    cls: type

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

    def _handle_invalid_blocks(self, invalid_block_ids):
        uncache = self.kv.uncache_blocks
        self.kv.uncache_blocks = lambda ids: None
        try:
            return super()._handle_invalid_blocks(invalid_block_ids)
        finally:
            self.kv.uncache_blocks = uncache


class PreemptKeepsBlocks(Scheduler):
    """A preempted request keeps its blocks (preemption frees nothing)."""

    def _preempt(self, request, plan):
        free = self.kv.free
        self.kv.free = lambda req: None
        try:
            super()._preempt(request, plan)
        finally:
            self.kv.free = free


MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("async_block_rounding",
           "async load sets num_computed_tokens = len(blocks) * block_size (pre-#34616)",
           "#34616 (seed 000)", "no_caching_of_invalid_blocks", AsyncBlockRounding),
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
