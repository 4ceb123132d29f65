"""The block pool's actions over a symbolic pool of bounded shape: which
request holds which block, reference counts, the free set, and what each block
holds: whether it is in the prefix cache, whether its content is valid (what
its hash names), and whether a load is still writing it.

Z3 proves the pool invariants inductive over every action, for every request
and block of a pool of ``NUM_REQUESTS`` requests and ``NUM_BLOCKS`` blocks,
without fenced frees, a connector's pins or delayed-free senders (Hypothesis
judges those on every step): ``ref_count_is_holders`` and ``free_queue_is_free_blocks`` with the
predicates the concrete invariants use, ``no_caching_of_invalid_blocks`` with
``is_cached_block_valid``, the predicate the data oracle applies to every
prefix-cache entry, and ``no_load_into_free_blocks`` with
``is_load_target_held``, which the oracle applies to every load in flight. Each action is one code path of the scheduler's pool use
(allocation, a prefix hit, a free, eviction, computing a block, a sync or async
load that succeeds or fails); its historical mutants are in ``spec/historical.py``.
"""
from __future__ import annotations

import attrs

from kvspec.spec.logic import And, If, Implies, Not
from kvspec.spec.predicates import (is_cached_block_valid, is_free_iff_unreferenced,
                                    is_load_target_held, is_ref_count_of_holders)

NUM_REQUESTS, NUM_BLOCKS = 3, 6


@attrs.frozen
class Pool:
    holds: tuple    # holds[r][b]: request r's block table contains block b
    ref: tuple      # ref[b]
    free: tuple     # free[b]: block b is in the free queue
    cached: tuple   # cached[b]: block b is in the prefix cache
    valid: tuple    # valid[b]: block b holds the content its hash names
    loading: tuple  # loading[b]: an async load is still writing block b


def pool_invariants(p: Pool) -> dict:
    blocks = range(len(p.ref))
    return {
        "ref_count_is_holders": And(*[is_ref_count_of_holders(p.ref[b], [h[b] for h in p.holds])
                                      for b in blocks]),
        "free_queue_is_free_blocks": And(*[is_free_iff_unreferenced(p.free[b], p.ref[b])
                                           for b in blocks]),
        "no_caching_of_invalid_blocks": And(*[is_cached_block_valid(p.cached[b], p.valid[b],
                                                                    p.loading[b])
                                              for b in blocks]),
        "no_load_into_free_blocks": And(*[is_load_target_held(p.loading[b], p.free[b])
                                          for b in blocks]),
    }


def _set(row, index, value):
    return tuple(value if i == index else v for i, v in enumerate(row))


def _hold(p: Pool, r: int, b: int, value):
    return _set(p.holds, r, _set(p.holds[r], b, value))


def act_allocate(p: Pool, r: int, b: int):
    """get_new_blocks: a free block is evicted from the prefix cache and gets its
    first holder; what it held before is stale."""
    return p.free[b], attrs.evolve(p, holds=_hold(p, r, b, True), ref=_set(p.ref, b, 1),
                                   free=_set(p.free, b, False), cached=_set(p.cached, b, False),
                                   valid=_set(p.valid, b, False),
                                   loading=_set(p.loading, b, False))


def act_touch(p: Pool, r: int, b: int):
    """A prefix-cache hit: a cached block gets one more holder, and leaves the
    free queue if it was there."""
    guard = And(Not(p.holds[r][b]), p.cached[b])
    return guard, attrs.evolve(p, holds=_hold(p, r, b, True), ref=_set(p.ref, b, p.ref[b] + 1),
                               free=_set(p.free, b, False))


def act_free(p: Pool, r: int):
    """A request frees its table: every block it held loses one reference. Not
    while a load is still writing a block it alone holds: the blocks wait until
    the worker reports the load (``cancel_load``), as vLLM keeps an aborted
    request's blocks until ``finished_recving``."""
    ref = tuple(If(p.holds[r][b], p.ref[b] - 1, p.ref[b]) for b in range(len(p.ref)))
    guard = And(*[Implies(And(p.holds[r][b], p.ref[b] == 1), Not(p.loading[b]))
                  for b in range(len(p.ref))])
    return guard, attrs.evolve(
        p, holds=_set(p.holds, r, tuple(False for _ in p.holds[r])), ref=ref,
        free=tuple(If(And(p.holds[r][b], ref[b] == 0), True, p.free[b])
                   for b in range(len(p.ref))))


def act_cancel_load(p: Pool, b: int):
    """The worker reports a load whose request ended: what it wrote is garbage,
    and it was never cached."""
    return p.loading[b], attrs.evolve(p, loading=_set(p.loading, b, False),
                                      valid=_set(p.valid, b, False))


def act_evict(p: Pool, b: int):
    """A cached free block leaves the prefix cache (to be reused)."""
    return And(p.free[b], p.cached[b]), attrs.evolve(p, cached=_set(p.cached, b, False))


def act_compute(p: Pool, r: int, b: int):
    """A holder computes a full block from a valid prefix; it is cached."""
    guard = And(p.holds[r][b], Not(p.loading[b]))
    return guard, attrs.evolve(p, valid=_set(p.valid, b, True), cached=_set(p.cached, b, True))


def act_compute_over_failure(p: Pool, r: int, b: int):
    """A holder computes a block in a step whose read hit a failed load: it holds
    garbage, and recovery drops it from the prefix cache."""
    guard = And(p.holds[r][b], Not(p.loading[b]))
    return guard, attrs.evolve(p, valid=_set(p.valid, b, False), cached=_set(p.cached, b, False))


def act_issue_async_load(p: Pool, r: int, b: int):
    """An async load starts writing a block only its request holds; the block is
    not cached until the load is reported finished."""
    guard = And(p.holds[r][b], p.ref[b] == 1, Not(p.cached[b]), Not(p.loading[b]))
    return guard, attrs.evolve(p, loading=_set(p.loading, b, True), valid=_set(p.valid, b, False))


def act_finish_async_load(p: Pool, b: int, ok: bool):
    """The load of a block is reported: a good block is cached, a failed one is not."""
    return p.loading[b], attrs.evolve(p, loading=_set(p.loading, b, False),
                                      valid=_set(p.valid, b, ok), cached=_set(p.cached, b, ok))


def act_sync_load(p: Pool, r: int, b: int, ok: bool):
    """A sync load writes a block in the step its request runs; by the end of the
    step a good block is cached and a failed one is not (recovery uncaches it)."""
    guard = And(p.holds[r][b], Not(p.loading[b]))
    return guard, attrs.evolve(p, valid=_set(p.valid, b, ok), cached=_set(p.cached, b, ok))


def act_reset_prefix_cache(p: Pool):
    """With every block free, the prefix cache is emptied."""
    return And(*p.free), attrs.evolve(p, cached=tuple(False for _ in p.cached))


#: action -> (effect, parameter names); "r" ranges over requests, "b" over
#: blocks, "ok" over load outcomes
POOL_ACTIONS = {
    "allocate": (act_allocate, ("r", "b")),
    "touch": (act_touch, ("r", "b")),
    "free": (act_free, ("r",)),
    "cancel_load": (act_cancel_load, ("b",)),
    "evict": (act_evict, ("b",)),
    "compute": (act_compute, ("r", "b")),
    "compute_over_failure": (act_compute_over_failure, ("r", "b")),
    "issue_async_load": (act_issue_async_load, ("r", "b")),
    "finish_async_load": (act_finish_async_load, ("b", "ok")),
    "sync_load": (act_sync_load, ("r", "b", "ok")),
    "reset_prefix_cache": (act_reset_prefix_cache, ()),
}
