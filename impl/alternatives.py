"""Correct designs that differ from the reference: the spec must admit them.

Each alternative is a subclass of the reference ``Scheduler`` that makes a
different choice where a correct scheduler may choose. It must pass every
safety claim; it may break a design rule (a rule of vLLM's current design),
which is why those are a separate role (``kvspec check --no-design-rules``).
"""
from __future__ import annotations

import attrs

from kvspec.impl.scheduler import Scheduler


@attrs.frozen
class Alternative:
    name: str
    description: str
    #: the design rules it breaks on purpose
    breaks: tuple[str, ...]
    cls: type


class ConservativeRecovery(Scheduler):
    """After a load failure every affected request recomputes from block 0: no
    owner, no waiters, the stats lowered to nothing. Safe and simple; it breaks
    vLLM's one-writer rule when several requests share the failed block."""

    def _recover(self, request, block_id, idx, owners):
        self._truncate(request, 0)


class LargestVictim(Scheduler):
    """Preemption frees the most memory at once: the running request holding the
    most blocks gives way (ties: the latest arrival), whatever the policy, except
    the oldest running request, which always keeps going. Without that exception
    two large requests can preempt each other forever (a hybrid layout found it:
    ``every_request_finishes``); with it the oldest finishes, then the next."""

    def _pick_victim(self):
        oldest = min(self.running, key=lambda r: r.arrival_time)
        candidates = [r for r in self.running if r is not oldest] or [oldest]
        return max(candidates, key=lambda r: (self._count_blocks(r), r.arrival_time))

    def _count_blocks(self, request) -> int:
        return sum(len(t) for t in self.kv.get_block_ids(request.request_id))


ALTERNATIVES: dict[str, Alternative] = {a.name: a for a in [
    Alternative("conservative_recovery",
                "every request a load failure affects recomputes from block 0",
                ("failed_block_recomputed_once",), ConservativeRecovery),
    Alternative("largest_victim",
                "preemption takes the running request holding the most blocks (never the oldest)",
                ("preemption_victim_follows_policy",), LargestVictim),
]}
