"""The faster checking of issue 30 judges exactly as before: each shortcut
against the definition it replaces, on random inputs, and the predicates the
shortcuts skip are true where they skip them."""
from __future__ import annotations

import pickle
import random
import copy

import pytest

from kvspec.spec.groups import NULL_BLOCK
from kvspec.spec.oracle import GARBAGE, UNDEFINED_CONTENT, KVContent, get_content
from kvspec.spec.predicates import (is_cached_block_valid, is_free_iff_unreferenced,
                                    is_ref_count_of_holders)
from kvspec.spec.reads import get_blocks_read, get_positions_read
from kvspec.spec.registry import Memo
from kvspec.spec.state import GroupSpec, RequestStatus

from random_runs import run_machine

GROUPS = [
    (GroupSpec(4),),
    (GroupSpec(2),),
    (GroupSpec(4), GroupSpec(4, "sliding_window", 5)),
    (GroupSpec(4), GroupSpec(2, "last_state")),
    (GroupSpec(2), GroupSpec(4, "sliding_window", 3), GroupSpec(4, "last_state")),
]


def _reference_first_invalid(content: KVContent, tables, keys, upto, before=None, groups=None):
    """``first_invalid`` as it was: every read position, one by one."""
    bad = [pos for g, group in enumerate(content.groups) if groups is None or g in groups
           for pos in get_positions_read(group, upto)
           if not content._is_valid(tables[g] if g < len(tables) else (), g, keys, pos,
                                    before)][:1]
    return bad[0] if bad else None


def _random_case(rng: random.Random, groups):
    num_blocks = 12
    content = KVContent(num_blocks, 4, groups)
    n = rng.randint(0, 20)
    keys = [rng.randint(0, 3) for _ in range(n)]
    tables = []
    for g, group in enumerate(groups):
        blocks = [rng.randrange(num_blocks) for _ in range(-(-22 // group.block_size))]
        if rng.random() < 0.3:
            blocks[rng.randrange(len(blocks))] = NULL_BLOCK
        tables.append(tuple(blocks[:rng.randint(0, len(blocks))]))
    # slots: mostly valid content for some table, sometimes garbage or a stray value
    for g, group in enumerate(groups):
        for pos in range(n + 2):
            index = pos // group.block_size
            if index < len(tables[g]) and tables[g][index] != NULL_BLOCK:
                r = rng.random()
                value = (get_content(g, keys, pos) if r < 0.85 else GARBAGE if r < 0.92
                         else UNDEFINED_CONTENT if r < 0.95 else rng.randint(0, 3))
                content._write(g, tables[g], pos, value)
    before = None
    if rng.random() < 0.3:
        before = {(rng.randrange(num_blocks), rng.randrange(4)): rng.choice([GARBAGE, 1, 2])
                  for _ in range(rng.randint(0, 3))}
    return content, tuple(tables), keys, before


@pytest.mark.parametrize("groups", GROUPS, ids=range(len(GROUPS)))
def test_first_invalid_is_the_first_invalid_position(groups):
    rng = random.Random(hash(groups) & 0xFFFF)
    for _ in range(1500):
        content, tables, keys, before = _random_case(rng, groups)
        upto = rng.randint(0, len(keys) + 3)
        judged = None if rng.random() < 0.5 else {g for g in range(len(groups))
                                                    if rng.random() < 0.6}
        for k in (keys, tuple(keys)):
            assert content.first_invalid(tables, k, upto, before, judged) == \
                _reference_first_invalid(content, tables, k, upto, before, judged)


def test_blocks_read_are_the_blocks_of_the_positions_read():
    for group in (GroupSpec(4), GroupSpec(3, "sliding_window", 5), GroupSpec(2, "last_state"),
                  GroupSpec(1)):
        for n in range(-2, 40):
            want = sorted({p // group.block_size for p in get_positions_read(group, n)})
            assert get_blocks_read(group, n) == want, (group, n)


def test_the_predicates_hold_where_the_claims_skip_them():
    # free_queue_is_free_blocks judges only blocks where "free" and "ref 0" disagree
    for free in (False, True):
        for ref in range(-3, 6):
            assert is_free_iff_unreferenced(free, ref) == (free == (ref == 0))
    # ref_count_is_holders skips ref == held
    for held in range(6):
        assert is_ref_count_of_holders(held, [True] * held)
    # no_caching_of_invalid_blocks skips a valid block no load is writing
    assert is_cached_block_valid(True, True, False)


def test_finished_statuses():
    for s in RequestStatus:
        assert s.is_finished == s.name.startswith("FINISHED")


def test_a_memo_pickles_and_copies_empty():
    memo = Memo(live=[1, 2])
    assert pickle.loads(pickle.dumps(memo)) == {} and copy.deepcopy(memo) == {}
    assert type(copy.deepcopy(memo)) is Memo


def _reference_holders(ctx) -> list[int]:
    """``_holders`` as it was: one table entry at a time."""
    count = [0] * ctx.obs.pool.num_blocks
    for r in ctx.obs.requests.values():
        for table in r.block_ids:
            for b in table:
                if b != NULL_BLOCK:
                    count[b] += 1
    for b in (*ctx.obs.pool.fenced, *ctx.obs.pool.pinned):
        count[b] += 1
    return count


def test_holders_count_every_table_fence_and_pin():
    from types import SimpleNamespace as NS

    from kvspec.spec.invariants import _holders
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(1, 10)
        pick = lambda k: tuple(rng.choice([NULL_BLOCK, *range(n)]) for _ in range(k))  # noqa: E731
        requests = {i: NS(block_ids=tuple(pick(rng.randint(0, 5)) for _ in range(rng.randint(0, 3))))
                    for i in range(rng.randint(0, 4))}
        ctx = NS(obs=NS(requests=requests, pool=NS(num_blocks=n, fenced=pick(rng.randint(0, 2)),
                                                   pinned=pick(rng.randint(0, 2)))))
        assert _holders(ctx) == _reference_holders(ctx)


def test_key_book_gives_the_prefix_keys_of_any_tokens():
    from kvspec.spec.oracle import KeyBook, extend_prefix_keys
    rng = random.Random(3)
    book = KeyBook()
    tokens: tuple = ()
    for _ in range(400):
        r = rng.random()
        tokens = (tokens + tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 3))) if r < 0.7
                  else tokens[:rng.randint(0, len(tokens))] if r < 0.85
                  else tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 6))))
        want: list = []
        extend_prefix_keys(want, tokens, 0)
        assert book.keys("r", tokens) == want
        assert book.keys("r", list(tokens)) == want


def test_an_unchanged_request_without_hints_is_the_same_to_the_model():
    """compute_admission skips a request equal before and after with no hints:
    what the loop would find for it."""
    from kvspec.spec.conformance import Hints, get_counters, is_same, must_recover
    from kvspec.spec.effects import GHOST_FIELDS
    from kvspec.spec.state import RequestView
    groups = (GroupSpec(4),)
    for status in RequestStatus:
        for computed, placeholders, cached in ((0, 0, -1), (5, 1, 4), (8, 0, 0)):
            r = RequestView(request_id="a", status=status, prompt_token_ids=(1, 2, 3, 4, 5),
                            output_token_ids=(6, 7, 8), max_tokens=9,
                            num_computed_tokens=computed, num_cached_tokens=cached,
                            num_external_computed_tokens=0, num_preemptions=1,
                            block_ids=((1, 2),), num_output_placeholders=placeholders)
            for ghost in (None, {f: 3 for f in GHOST_FIELDS}):
                before = get_counters(r, groups, ghost)
                assert is_same(before, get_counters(r, groups))
                assert not must_recover(before, Hints())


def test_the_first_missing_read_is_the_first_of_every_block_read_and_missing():
    """``every_group_serves_computed`` names the first block a step reads that
    the table lacks without listing every block read (full attention: the
    first NULL_BLOCK wherever it is, as before)."""
    from kvspec.spec.invariants import get_first_missing_read
    rng = random.Random(3)
    for _ in range(3000):
        group = rng.choice([GroupSpec(4), GroupSpec(2), GroupSpec(4, "sliding_window", 5),
                            GroupSpec(4, "last_state")])
        table = tuple(rng.choice([NULL_BLOCK, 1, 2, 3]) for _ in range(rng.randint(0, 8)))
        real = rng.randint(0, 40)
        missing = [i for i in get_blocks_read(group, real)
                   if i >= len(table) or table[i] == NULL_BLOCK]
        if group.kind == "full_attention" and NULL_BLOCK in table:
            missing = [table.index(NULL_BLOCK)]
        assert get_first_missing_read(group, table, real) == missing[:1], (group, table, real)


def _offered_from_scratch(content: KVContent, obs) -> tuple:
    """``get_offered``'s definition: every cached block's slots as each block
    size keeps them, and its last slot (where some group keeps one state),
    counted over the blocks cached now."""
    from collections import Counter
    sizes = sorted({g.block_size for g in content.groups})
    contents, lasts = Counter(), Counter()
    has_last_state = any(g.kind == "last_state" for g in content.groups)
    for b in {b for _key, b in obs.pool.cached}:
        contents.update(tuple(content.slots[b][:size]) for size in sizes)
        lasts[content.slots[b][-1]] += has_last_state
    return contents, +lasts


@pytest.mark.parametrize("target", ["impl", "mutant:cache_failed_block"])
def test_the_offered_books_are_what_the_cache_offers(target, monkeypatch):
    """``get_offered`` reads again only blocks that entered the cache or were
    written since its last call (by the write log while the target hands back
    the very same entries): after every call its books equal a count from
    scratch, and the step's snapshot equals them at the step's start, on
    random runs with load failures, preemptions, resets and several groups."""

    from kvspec.harness.machine import machine_for
    original_offered, original_start = KVContent.get_offered, KVContent.note_step_start
    calls = {"offered": 0, "fast": 0}

    def get_offered(self, obs):
        fast = self._offered.get("entries") is obs.pool.cached
        got = original_offered(self, obs)
        assert tuple(map(dict, got)) == tuple(map(dict, _offered_from_scratch(self, obs)))
        calls["offered"] += 1
        calls["fast"] += fast
        return got

    def note_step_start(self, obs):
        original_start(self, obs)
        want = tuple(map(frozenset, _offered_from_scratch(self, obs)))
        assert tuple(map(frozenset, self.offered_at_start)) == want
    monkeypatch.setattr(KVContent, "get_offered", get_offered)
    monkeypatch.setattr(KVContent, "note_step_start", note_step_start)
    # a mutant's violation ends its run quietly: the books are what is judged here
    machine = machine_for(target, on_counterexample=lambda exc: True)
    run_machine(machine, 11, 20, 25)
    assert calls["offered"] > 200 and calls["fast"] > 100, calls


@pytest.mark.parametrize("groups", GROUPS, ids=range(len(GROUPS)))
@pytest.mark.parametrize("logged", [True, False], ids=["write-log", "no-log"])
def test_the_offered_books_follow_writes_and_entries(groups, logged):
    """The same books, at random: blocks cached and evicted (a new entries tuple,
    or the very same one kept), slots written in between, a copy of the
    oracle; the write log started by a reader part way (the writes before
    were never logged) and trimmed as it reads, or never read."""
    from types import SimpleNamespace
    rng = random.Random(7)
    content = KVContent(12, 4, groups)
    entries = ()
    fast, at_start = 0, (frozenset(), frozenset())
    for _ in range(400):
        for roll in [rng.random() for _ in range(rng.randint(1, 3))]:
            if roll < 0.2:
                entries = tuple({(rng.randrange(6), rng.randrange(12))
                                 for _ in range(rng.randint(0, 6))})
            elif roll < 0.7:
                b = rng.randrange(12)
                content._write_slot(b, rng.randrange(len(content.slots[b])),
                                    rng.choice([GARBAGE, 1, 2, 3]))
            elif roll < 0.75:
                content = copy.deepcopy(content)
            elif logged and roll < 0.85:  # the other reader moves on: the log forgets
                reader = content.changed_blocks.offset + len(content.changed_blocks.items)
                content.changed_blocks.trim(reader - rng.randint(0, 1))
            elif logged and roll < 0.9:  # a reader takes its first mark: the log starts
                if entries and not content.changed_blocks.active:  # right after a write
                    b = rng.choice(entries)[1]
                    content._write_slot(b, 0, rng.choice([GARBAGE, 1, 2, 3]))
                content.changed_blocks.mark()
            elif roll < 0.93:  # a new oracle: its log not started
                content, at_start = KVContent(12, 4, groups), (frozenset(), frozenset())
        obs = SimpleNamespace(pool=SimpleNamespace(cached=entries))
        fast += content._offered.get("entries") is entries and content.changed_blocks.active
        got = content.get_offered(obs)
        assert tuple(map(dict, got)) == tuple(map(dict, _offered_from_scratch(content, obs)))
        # the last step's start is what it was, whatever the books counted since
        assert tuple(map(frozenset, content.offered_at_start)) == at_start
        if rng.random() < 0.5:
            content.note_step_start(obs)
            at_start = tuple(map(frozenset, _offered_from_scratch(content, obs)))
            assert tuple(map(frozenset, content.offered_at_start)) == at_start
    assert fast > 100 if logged else fast == 0


def test_a_key_cached_at_the_start_is_one_that_splits_to_it():
    """``_was_key_cached``: some entry cached when the step began splits
    (``split_cache_key``) to the hash and group asked, for keys of every
    shape: plain hashes, group keys (of group 0 too), and hashes that look
    like group keys."""
    from kvspec.spec.groups import GROUP_KEY, split_cache_key
    rng = random.Random(5)
    hashes = [1, 2, (GROUP_KEY, 1, 2), (GROUP_KEY, 0, 1), "x"]
    content = KVContent(4, 4)
    for _ in range(500):
        keys = [rng.choice(hashes) if rng.random() < 0.5 else
                (GROUP_KEY, rng.randrange(3), rng.choice(hashes)) for _ in range(rng.randint(0, 5))]
        content.cached_at_start = tuple((k, b) for b, k in enumerate(keys))
        split = {split_cache_key(k) for k in keys}
        for h in hashes:
            for g in range(3):
                assert content._was_key_cached(h, g) == ((h, g) in split), (keys, h, g)


def _random_entries(rng: random.Random, last: tuple) -> tuple:
    """The next prefix-cache tuple: entries evicted, cached, reordered, a tuple
    unrelated to the last, a key cached under several blocks, an entry twice."""
    kind = rng.randrange(6)
    if kind == 0 or not last:  # unrelated
        return tuple((rng.randrange(40), rng.randrange(30)) for _ in range(rng.randrange(0, 60)))
    entries = [e for e in last if rng.random() > 0.1]  # some evicted
    entries += [(rng.randrange(40), rng.randrange(30)) for _ in range(rng.randrange(0, 6))]
    if kind == 1:
        rng.shuffle(entries)
    if kind == 2 and entries:  # the very same entry twice
        entries.append(rng.choice(entries))
    if kind == 3:
        return last  # the very tuple again
    return tuple(entries)


def test_the_cache_index_is_the_tuple_it_was_asked_about():
    """``get_cache_index`` (moved from tuple to tuple by differences) against
    an index built afresh of every tuple, in random orders, tuples revisited."""
    from kvspec.spec.cache_index import CacheIndex
    rng = random.Random(7)
    index, seen, applied = CacheIndex(), [()], 0
    for _ in range(3000):
        entries = rng.choice(seen) if rng.random() < 0.1 else _random_entries(rng, seen[-1])
        seen = (seen + [entries])[-5:]
        before, books = index.entries, index.by_block
        index.describe(entries)
        applied += entries is not before and index.by_block is books  # brought by a difference
        by_block, by_key = {}, {}
        for key, block in entries:
            by_block.setdefault(block, []).append(key)
            by_key.setdefault(key, []).append(block)
        assert {b: sorted(keys) for b, keys in index.by_block.items()} == \
            {b: sorted(keys) for b, keys in by_block.items()}, entries
        assert {k: sorted(blocks) for k, blocks in index.by_key.items()} == \
            {k: sorted(blocks) for k, blocks in by_key.items()}, entries
        assert index.shared == {b for b, keys in by_block.items() if len(keys) >= 2}
    assert applied > 300  # the differences were used


def test_the_table_tally_counts_every_table_of_the_requests_asked_about():
    """``TableTally`` (moved from requests to requests table by table) against
    a count of every entry of every table, with views kept, tables grown at
    their end, cut, replaced, requests leaving and coming back."""
    from collections import Counter
    from types import SimpleNamespace
    from kvspec.spec.table_tally import TableTally
    rng = random.Random(11)
    tally, requests = TableTally(), {}
    for _ in range(3000):
        requests = dict(requests)
        for rid in [f"r{i}" for i in range(rng.randrange(0, 6))]:
            old = requests.get(rid)
            tables = old.block_ids if old is not None else ()
            kind = rng.randrange(5)
            if kind == 0:
                requests.pop(rid, None)
                continue
            if kind == 1:  # a group grows at its end (the others: the very tuples)
                g = rng.randrange(2)
                tables = tuple(t + tuple(rng.randrange(-1, 20) for _ in range(rng.randrange(3)))
                               if i == g else t for i, t in enumerate(tables or ((), ())))
            elif kind == 2:  # cut or rewritten
                tables = tuple(tuple(rng.randrange(-1, 20) for _ in range(rng.randrange(4)))
                               for _ in range(rng.randrange(3)))
            elif kind == 3:  # equal, another object
                tables = tuple(tuple(t) for t in tables)
            requests[rid] = SimpleNamespace(block_ids=tables)
        want = Counter(b for r in requests.values() for t in r.block_ids for b in t)
        got = tally.describe(requests)
        assert +got == want
