"""The block pool's actions over a symbolic pool of bounded shape: which
request holds which block, reference counts, the free set. Z3 proves the pool
invariants (``is_ref_count_of_holders``, ``is_free_iff_unreferenced``, the
predicates the concrete invariants use) inductive over every action."""
from __future__ import annotations

import attrs

from kvspec.spec.logic import And, If, Not
from kvspec.spec.predicates import is_free_iff_unreferenced, is_ref_count_of_holders

NUM_REQUESTS, NUM_BLOCKS = 3, 8


@attrs.frozen
class Pool:
    holds: tuple  # holds[r][b]: request r's block table contains block b
    ref: tuple    # ref[b]
    free: tuple   # free[b]: block b is in the free queue


def pool_invariants(p: Pool) -> dict:
    return {
        "ref_count_is_holders": And(*[is_ref_count_of_holders(p.ref[b], [h[b] for h in p.holds])
                                      for b in range(len(p.ref))]),
        "free_queue_is_free_blocks": And(*[is_free_iff_unreferenced(p.free[b], p.ref[b])
                                           for b in range(len(p.ref))]),
    }


def _set(row, index, value):
    return tuple(value if i == index else v for i, v in enumerate(row))


def act_allocate(p: Pool, r: int, b: int):
    """get_new_blocks: a free block gets its first holder."""
    guard = p.free[b]
    holds = _set(p.holds, r, _set(p.holds[r], b, True))
    return guard, Pool(holds, _set(p.ref, b, 1), _set(p.free, b, False))


def act_touch(p: Pool, r: int, b: int):
    """A prefix-cache hit: one more holder, out of the free queue if it was there."""
    guard = Not(p.holds[r][b])
    holds = _set(p.holds, r, _set(p.holds[r], b, True))
    return guard, Pool(holds, _set(p.ref, b, p.ref[b] + 1), _set(p.free, b, False))


def act_free(p: Pool, r: int):
    """A request frees its table: every block it held loses one reference."""
    ref = tuple(If(p.holds[r][b], p.ref[b] - 1, p.ref[b]) for b in range(len(p.ref)))
    free = tuple(If(p.holds[r][b], ref[b] == 0, p.free[b]) for b in range(len(p.ref)))
    holds = _set(p.holds, r, tuple(False for _ in p.holds[r]))
    return True, Pool(holds, ref, free)


def act_evict(p: Pool, b: int):
    """Evicting a cached free block for reuse changes no holder or count."""
    return p.free[b], p


POOL_ACTIONS = {
    "allocate": (act_allocate, ("r", "b")),
    "touch": (act_touch, ("r", "b")),
    "free": (act_free, ("r",)),
    "evict": (act_evict, ("b",)),
}
