"""Incremental checking: what changed since the claims last held, as a
``Scope`` (``spec/scope.py``), and when to check everything instead.

A check's baseline is the last state judged in the same mode (synced or not:
``computed_within_tokens`` and the data claims read it). What changed since
is read from four places, each cheap next to judging every conjunct:

- the observation: request views that are not the very view of the baseline
  (the targets hand back the same view while every field is equal), requests
  that came or left, queue membership, reference counts, free-queue,
  prefix-cache (the entries lost and gained), fenced and pinned entries;
- the ghost's log of the requests its history events touched (``spec/history.py``);
- the data oracle's log of blocks whose content or unreported-failure mark
  changed, the hashes it learnt, and the blocks async loads now write;
- holders: the blocks a changed request's tables gained or lost, and every
  request holding a block whose content changed.

Everything is judged at the first check of each mode, every ``full_every``
checks, and at the end of a run (``Runner.finish``, the healed phase).
"""
from __future__ import annotations

import os

import attrs

from kvspec.spec.cache_index import get_cache_index, get_entry_set
from kvspec.spec.groups import get_group_cache_key
from kvspec.spec.invariants import Context, get_free_set
from kvspec.spec.scope import Scope
from kvspec.spec.state import Observation, PoolView

#: a full check after this many incremental ones, per mode (1: every check is full)
FULL_CHECK_EVERY = 64
#: overrides it for a whole run, its workers included (``--full-check-every``)
FULL_CHECK_EVERY_ENV = "KVSPEC_FULL_CHECK_EVERY"


def get_full_every() -> int:
    """The interval this process checks everything at (``FULL_CHECK_EVERY_ENV``)."""
    raw = os.environ.get(FULL_CHECK_EVERY_ENV, "").strip()
    if not raw:
        return FULL_CHECK_EVERY
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{FULL_CHECK_EVERY_ENV}={raw!r}: a whole number of checks, at least 1")
    return int(raw)


@attrs.define
class Baseline:
    """The last state judged in one mode, and the logs' marks then."""

    obs: Observation
    ghost_mark: int
    block_mark: int
    hash_mark: int
    loading: frozenset
    #: incremental checks since the last full one
    since_full: int


class Incremental:
    def __init__(self, full_every: int = FULL_CHECK_EVERY) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, not {full_every}")
        self.full_every = full_every
        self.baselines: dict[bool, Baseline] = {}
        #: checks made, and how many of them judged everything
        self.checks = self.full_checks = 0

    def get_scope(self, ctx: Context) -> Scope | None:
        """What ``ctx`` must judge, or None: everything."""
        base = self.baselines.get(ctx.synced)
        if base is None or base.since_full + 1 >= self.full_every or ctx.oracle is None:
            return None
        return compute_scope(base, ctx)

    def advance(self, ctx: Context, scope: Scope | None) -> None:
        """``ctx`` was judged (with ``scope``): it is its mode's baseline now."""
        base = self.baselines.get(ctx.synced)
        self.checks += 1
        self.full_checks += scope is None
        oracle = ctx.oracle
        self.baselines[ctx.synced] = Baseline(
            ctx.obs, ctx.ghost.touched.mark(),
            oracle.changed_blocks.mark() if oracle else 0,
            oracle.learned_hashes.mark() if oracle else 0,
            frozenset(oracle.loading_blocks()) if oracle else frozenset(),
            0 if scope is None or base is None else base.since_full + 1)
        self._trim(ctx)

    def _trim(self, ctx: Context) -> None:
        marks = self.baselines.values()
        ctx.ghost.touched.trim(min(b.ghost_mark for b in marks))
        if ctx.oracle is not None:
            ctx.oracle.changed_blocks.trim(min(b.block_mark for b in marks))
            ctx.oracle.learned_hashes.trim(min(b.hash_mark for b in marks))


def compute_scope(base: Baseline, ctx: Context) -> Scope | None:
    """The requests and blocks whose conjuncts may have changed since ``base``
    (None: the pool changed shape, judge everything)."""
    before, after = base.obs, ctx.obs
    if before.pool.num_blocks != after.pool.num_blocks:
        return None
    requests = get_changed_requests(before, after)
    requests.update(ctx.ghost.touched.since(base.ghost_mark))
    gone, came = get_cache_changes(before.pool.cached, after.pool.cached)
    blocks = get_changed_pool_blocks(before.pool, after.pool, gone | came)
    for rid in requests:
        blocks |= get_table_changes(before.requests.get(rid), after.requests.get(rid))
    content = get_changed_content(base, ctx, gone, came)
    if content:
        blocks |= content
        requests.update(get_holders_of(after, content, requests))
    cached = content.union(b for _key, b in gone | came)
    return Scope(frozenset(requests), frozenset(blocks), frozenset(cached))


def get_changed_requests(before: Observation, after: Observation) -> set[str]:
    """Requests whose view differs, that came or left, or whose queue
    membership changed. A view is another object only where a field changed
    (the targets hand back the very view while every field is equal), so
    identity decides; an equal copy would only widen the scope."""
    old = before.requests
    changed = {rid for rid, r in after.requests.items() if old.get(rid) is not r}
    changed.update(rid for rid in old if rid not in after.requests)
    for queue_before, queue_after in ((before.running, after.running),
                                      (before.waiting, after.waiting)):
        if queue_before != queue_after:
            changed |= set(queue_before).symmetric_difference(queue_after)
    return changed


def get_cache_changes(before: tuple, after: tuple) -> tuple[frozenset, frozenset]:
    """The prefix-cache entries ``after`` lost, and those it gained."""
    if before is after or (len(before) == len(after) and before == after):
        return frozenset(), frozenset()
    old, new = get_entry_set(before), get_entry_set(after)
    return old - new, new - old


def get_changed_pool_blocks(before: PoolView, after: PoolView, cache_changes) -> set[int]:
    """Blocks whose count, free-queue entry, prefix-cache entries
    (``cache_changes``: those lost or gained), fences or pins changed."""
    blocks: set[int] = set()
    if before.ref_cnt != after.ref_cnt:
        blocks.update(get_changed_positions(before.ref_cnt, after.ref_cnt))
    if before.free_queue != after.free_queue:
        blocks |= get_free_set(before.free_queue) ^ get_free_set(after.free_queue)
    blocks.update(b for _key, b in cache_changes)
    for old, new in ((before.fenced, after.fenced), (before.pinned, after.pinned)):
        if old != new:
            blocks.update(old, new)
    return blocks


#: ``get_changed_positions`` compares this many entries at once (a C loop)
CHUNK = 64


def get_changed_positions(old: tuple, new: tuple) -> list[int]:
    """The positions at which two tuples of the same length differ: slices
    compared whole, position by position only inside a slice that differs
    (a step changes a few counts of a pool of thousands)."""
    changed = []
    for start in range(0, len(new), CHUNK):
        end = start + CHUNK
        if old[start:end] != new[start:end]:
            changed += [i for i in range(start, min(end, len(new))) if old[i] != new[i]]
    return changed


def get_changed_content(base: Baseline, ctx: Context, gone: frozenset,
                        came: frozenset) -> set[int]:
    """Blocks whose content, unreported-failure mark or async load changed, and
    cached blocks named by a hash learnt since (judgeable only now). ``gone``,
    ``came``: the prefix-cache entries lost and gained since ``base``."""
    oracle = ctx.oracle
    content = set(oracle.changed_blocks.since(base.block_mark))
    content |= base.loading.symmetric_difference(oracle.loading_blocks())
    learned = oracle.learned_hashes.since(base.hash_mark)
    if learned:
        # a key cached before its hash was learnt was not judgeable then (one
        # cached since is in the scope already): its blocks are judged now
        index = get_cache_index(ctx.obs.pool.cached)
        keys = {get_group_cache_key(h, g) for h in learned for g in range(len(oracle.groups))}
        gone_keys = {key for key, _b in gone}
        for key in [key for key in keys if key in index.by_key]:  # (not a pass over the cache)
            # cached at the baseline too: an entry of it not new since, or one gone
            blocks = index.blocks_of(key)
            if key in gone_keys or any((key, b) not in came for b in blocks):
                content.update(blocks)
    return content


def get_table_changes(before, after) -> set[int]:
    """Blocks a request holds a different number of times (its holders changed):
    what a table gained or lost at its end, or every block of a table that changed otherwise."""
    old = before.block_ids if before is not None else ()
    new = after.block_ids if after is not None else ()
    if old == new:
        return set()
    changed: set[int] = set()
    for g in range(max(len(old), len(new))):
        a, b = old[g] if g < len(old) else (), new[g] if g < len(new) else ()
        if a == b:
            continue
        short, long = (a, b) if len(a) <= len(b) else (b, a)
        changed.update(long[len(short):] if long[:len(short)] == short else (*a, *b))
    return changed


def get_holders_of(obs: Observation, blocks: set[int], known: set[str]) -> list[str]:
    """Requests (beyond ``known``) holding one of ``blocks``."""
    return [rid for rid, r in obs.requests.items() if rid not in known
            and any(not blocks.isdisjoint(table) for table in r.block_ids)]
