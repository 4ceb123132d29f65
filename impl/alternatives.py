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
    most blocks gives way (ties: the latest arrival), whatever the policy."""

    def _pick_victim(self):
        return max(self.running, key=lambda r: (len(self.kv.get_block_ids(r.request_id)[0]),
                                                r.arrival_time))


ALTERNATIVES: dict[str, Alternative] = {a.name: a for a in [
    Alternative("conservative_recovery",
                "every request a load failure affects recomputes from block 0",
                ("failed_block_recomputed_once",), ConservativeRecovery),
    Alternative("largest_victim",
                "preemption takes the running request holding the most blocks",
                ("preemption_victim_follows_policy",), LargestVictim),
]}
