"""The data oracle: a model of the worker that tracks what every physical
block holds, so that counters agreeing cannot hide wrong KV.

Content of a slot is the *prefix key* of the position it holds: a hash of all
tokens up to and including that position (the KV of a position depends on the
whole prefix). ``GARBAGE`` is anything else: never written, a failed load, or
computed from garbage.

With several KV cache groups a slot's content is tagged with its group (a
sliding-window layer's KV is not a full-attention layer's), and each group is
read as its kind reads (``spec/groups.py``): full attention every earlier
position, a sliding window the last ``w - 1``, a last-state group the state
after the previous token. A load writes the positions a group holds blocks for.

A last-state group's block holds one state, as vLLM's Mamba "align" mode keeps
it: the state after the last position written into that block (kept in the
block's last slot; its other slots stay ``GARBAGE``). Writing any position of
the block replaces that state, so the state after ``q + 1`` tokens can be read
only while position ``q`` is the last one written into its block: a step from
``q + 1`` after a later position of that block was written (a load past it,
rejected drafts) reads that position's state. A step reads a state before it
writes its own: a request's read of a slot it writes itself in the same step
sees the slot as the step found it (decoding mid-block is valid).

Timing follows vLLM's worker:
- in one step every scheduled token's KV is written before any attention of
  that step reads, so a block recomputed by one request is valid for another
  request reading it in the same step; a request that reads garbage writes garbage;
- a sync load runs in the step its request is scheduled; an async load writes
  only when the environment reports it in ``finished_recving``;
- a block held for a send must keep its content until ``finished_sending``.

Under async scheduling a step is in flight while the next is scheduled. Its
writes land in stream order: a later step reads them (the GPU runs steps one
after another), so the oracle applies them when the step executes. Anything
not ordered with the compute stream (a connector's load, a send's source) does
not wait for them: a step's writes land again when it completes, over any slot
no later step has written since, so a load into a block freed under a step in
flight is clobbered (vLLM defers such frees: ``defer_block_free``), while a send
runs after the steps launched before it.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Iterator

import attrs

from kvspec.spec.cache_index import get_cache_index
from kvspec.spec.groups import GROUP_KEY, NULL_BLOCK, is_group_cache_key, split_cache_key
from kvspec.spec.reads import get_blocks_read, get_positions_read
from kvspec.spec.predicates import is_cached_block_valid
from kvspec.spec.registry import DerivedByIdentity, Memo
from kvspec.spec.scope import ChangeLog
from kvspec.spec.state import GroupSpec, Observation, RequestStatus, RequestView, StepView

GARBAGE = None


def extend_prefix_keys(keys: list[int], tokens, start: int) -> None:
    append_prefix_keys(keys, tokens[start:], keys[start - 1] if start else 0)


def append_prefix_keys(keys: list[int], tokens, prev: int) -> None:
    """The keys of ``tokens`` following a position whose key is ``prev``."""
    for token in tokens:
        prev = hash((prev, token))
        keys.append(prev)


class KeyBook:
    """Prefix keys of each request's tokens, extended as tokens are appended."""

    def __init__(self) -> None:
        self._book: dict[str, tuple[tuple[int, ...], list[int]]] = {}
        #: request id -> (prompt, outputs, their keys) as ``keys_of`` last saw them
        self._views: dict[str, tuple] = {}

    def keys(self, request_id: str, tokens: tuple[int, ...]) -> list[int]:
        toks, keys = self._book.get(request_id, ((), []))
        n = len(toks)
        if toks != tokens[:n]:
            keys, n = [], 0
        if n < len(tokens) or n == 0:
            extend_prefix_keys(keys, tokens, n)
            self._book[request_id] = (tuple(tokens), keys)
        return keys

    def get_known(self, request_id: str) -> list[int]:
        """The keys last computed for the request's tokens (none if never)."""
        return self._book.get(request_id, ((), []))[1]

    def keys_of(self, r: RequestView) -> list[int]:
        """``keys`` of a view's tokens, its prompt and outputs compared apart
        (no copy of all its tokens; an unchanged prompt is the same tuple)."""
        known = self._views.get(r.request_id)
        if known is None or not (known[0] is r.prompt_token_ids
                                 or known[0] == r.prompt_token_ids) \
                or r.output_token_ids[:len(known[1])] != known[1]:
            keys = list(self.keys(r.request_id, r.all_token_ids))
        else:
            keys = known[2]
            append_prefix_keys(keys, r.output_token_ids[len(known[1]):], keys[-1] if keys else 0)
        self._views[r.request_id] = (r.prompt_token_ids, r.output_token_ids, keys)
        return keys

    def forget(self, request_id: str) -> None:
        self._book.pop(request_id, None)
        self._views.pop(request_id, None)


#: what a step writes at a position past every token the request has: no
#: valid content equals it. Only a broken scheduler computes there; the claims
#: say so (``computed_within_tokens``, the conformance model), and the oracle
#: must not crash first when only some kinds of claims are checked.
UNDEFINED_CONTENT = ("undefined",)


def get_content(group_index: int, keys, pos: int):
    """What a valid slot of ``group_index`` holds for position ``pos``."""
    if pos >= len(keys):
        return UNDEFINED_CONTENT
    return keys[pos] if group_index == 0 else (group_index, keys[pos])


def get_contents(group_index: int, keys, lo: int, hi: int) -> list:
    """``get_content`` of positions ``[lo, hi)``, as a list."""
    if hi > len(keys):
        return [get_content(group_index, keys, pos) for pos in range(lo, hi)]
    if group_index == 0:
        return list(keys[lo:hi])
    return [(group_index, key) for key in keys[lo:hi]]


#: a slot a step does not write, in ``FoundByStep``
_UNSEEN = ("unseen",)


class FoundByStep(dict):
    """What a step found in the slots it writes (block -> its slots then,
    ``_UNSEEN`` where the step does not write): its reads of those slots see
    this, not what it wrote itself."""

    @classmethod
    def of(cls, before) -> "FoundByStep | None":
        """``before`` as given to ``first_invalid``: this, or a dict (block,
        slot) -> value."""
        if before is None or isinstance(before, cls):
            return before
        found = cls()
        for (b, s), value in before.items():
            seen = found.setdefault(b, [])
            seen.extend([_UNSEEN] * (s + 1 - len(seen)))
            seen[s] = value
        return found

    def take(self, slots: list, b: int, lo: int, hi: int) -> None:
        """Slots ``[lo, hi)`` of block ``b`` (``slots``: the block's) as they are now."""
        seen = self.get(b)
        if seen is None:
            seen = self[b] = [_UNSEEN] * len(slots)
        seen[lo:hi] = slots[lo:hi]

    def read(self, slots: list, b: int, s: int):
        """What the step reads in slot ``s`` of block ``b`` (``slots``: the block's)."""
        seen = self.get(b)
        if seen is None or s >= len(seen) or seen[s] is _UNSEEN:
            return slots[s]
        return seen[s]


@attrs.define
class LoadJob:
    request_id: str
    #: one table per group
    block_ids: tuple[tuple[int, ...], ...]
    start: int
    num_tokens: int
    is_async: bool
    keys: list[int]
    #: what a real connector's store held for each position it loads (group 0;
    #: a position missing holds garbage); None: the valid content (kvspec's store)
    values: dict | None = None


@attrs.define
class ExecReport:
    finished_recving: set[str] = attrs.Factory(set)
    #: async loads that finished in this step without a failed block
    loaded_ok: set[str] = attrs.Factory(set)
    invalid_block_ids: set[int] = attrs.Factory(set)
    #: request id -> first position it read that was not valid
    garbage_readers: dict[str, int] = attrs.Factory(dict)
    #: blocks a garbage reader wrote its garbage into this step (any group)
    garbage_blocks: set[int] = attrs.Factory(set)
    #: the step's id, to complete it when its output is back
    step_id: int = -1


#: the keys of a prefix-cache tuple of (key, block) entries, as a dict (key -> a block)
get_key_index = DerivedByIdentity(dict)


def _get_entries_of(cached: tuple, blocks) -> list | tuple:
    """The entries of ``cached`` naming one of ``blocks`` (None: all of them)."""
    if blocks is None:
        return cached
    index = get_cache_index(cached)
    return [(key, b) for b in sorted(blocks) for key in index.keys_of(b)]


class OfferedAtStart:
    """What one kind of ``get_offered``'s books offered when a step began,
    without copying them: the live count, or for a value counted differently
    since, its count then (``undo``, kept by ``get_offered`` at each value's
    first change). A copy or a pickle is the frozen set (the copy's books
    start again from nothing)."""

    def __init__(self, live: Counter) -> None:
        self.live, self.undo = live, {}

    def __contains__(self, value) -> bool:
        count = self.undo.get(value)
        return (self.live.get(value, 0) if count is None else count) > 0

    def __iter__(self):
        yield from (v for v in self.live if v not in self.undo)
        yield from (v for v, count in self.undo.items() if count > 0)

    def __deepcopy__(self, memo) -> frozenset:
        return frozenset(self)

    def __reduce__(self):
        return frozenset, (tuple(self),)


def _count(counter: Counter, values, by: int, undo: dict | None) -> None:
    """Add ``by`` to the count of each of ``values`` (a count reaching 0 is
    dropped), noting in ``undo`` each value's count before its first change."""
    for value in values:
        count = counter.get(value, 0)
        if undo is not None and value not in undo:
            undo[value] = count
        if count + by > 0:
            counter[value] = count + by
        else:
            counter.pop(value, None)


def _count_holders(obs: Observation) -> dict[int, int]:
    count: dict[int, int] = {}
    for r in obs.requests.values():
        for b in _held(r):
            count[b] = count.get(b, 0) + 1
    return count


def _held(r: RequestView) -> set[int]:
    return {b for table in r.block_ids for b in table if b != NULL_BLOCK}


class KVContent:
    def __init__(self, num_blocks: int, block_size: int,
                 groups: tuple[GroupSpec, ...] | None = None) -> None:
        self.groups = groups or (GroupSpec(block_size),)
        #: slots per block: the largest group's block size (a group of smaller
        #: blocks uses the first slots of each)
        self.block_size = max(g.block_size for g in self.groups)
        #: tokens per block hash, and where a prefix hit may end (``Config``)
        self.hash_block_size = math.gcd(*(g.block_size for g in self.groups))
        self.scheduler_block_size = math.lcm(*(g.block_size for g in self.groups))
        self.slots: list[list] = [[GARBAGE] * self.block_size for _ in range(num_blocks)]
        self.expected_by_hash: dict[Hashable, tuple] = {}
        #: blocks whose content, or whose "failure not yet reported" mark,
        #: changed; and hashes learnt: an incremental check judges what they
        #: touch again (``spec/scope.py``)
        self.changed_blocks = ChangeLog()
        self.learned_hashes = ChangeLog()
        #: every slot write is numbered; each block keeps the number of its last
        #: write, so a prefix found valid is known unchanged without reading it
        self.write_clock = 0
        self.last_write = [0] * num_blocks
        #: (request id, group) -> (end, the key at end - 1, the table's blocks
        #: up to end, write clock then): a full-attention prefix found valid
        #: (``first_invalid`` reads only past it while none of those blocks is
        #: written again); a cache, never a verdict
        self._valid_prefix: dict = Memo()
        #: request id -> its block hashes ``learn`` went through, every one known
        self._hashes_seen: dict = Memo()
        #: ``get_offered``'s books: per cached block what it offered, and counts
        self._offered: dict = Memo()
        #: (hash, group) -> the slots a block of the group cached under it holds
        #: (``_want`` of what the hash names): derived from ``expected_by_hash``,
        #: whose entries never change, so computed once
        self._named_wants: dict[tuple, list] = Memo()
        #: cache key -> (whether its group keeps every slot, ``_named_wants`` of it)
        self._wants_by_key: dict = Memo()
        self.loads: dict[str, LoadJob] = {}
        #: async loads of requests that ended mid-load: the environment drops
        #: them, but a worker cannot call a transfer back, so while the
        #: scheduler still holds such a request (waiting for the worker's
        #: report) its load may still be writing every block it was given
        self.orphaned_loads: dict[str, LoadJob] = {}
        #: request id -> slot -> (what it held when the send began, its valid content)
        self.sends: dict[str, dict[tuple[int, int], tuple]] = {}
        self.book = KeyBook()
        #: slots two requests wrote in the last step: (block, slot, first, second)
        self.double_writes: list[tuple[int, int, str, str]] = []
        #: blocks a failed load left garbage in, until something valid is written there
        self.failed_blocks: set[int] = set()
        #: failed blocks held by several requests that the last step recomputed
        self.shared_recomputes = 0
        #: async scheduling: the step that last wrote each slot in stream order,
        #: and each step in flight's writes (slot -> value), until it completes
        #: (per block, the step id per slot; per step, (block, first slot,
        #: values) runs)
        self.stream_writer: dict[int, list] = {}
        self.in_flight: dict[int, list[tuple[int, int, list]]] = {}
        #: per step in flight, the blocks a failed load of it left bad and the
        #: blocks its readers of bad KV wrote: the scheduler learns of them only
        #: with the step's output, so until then they are not its fault
        self.unreported: dict[int, set[int]] = {}
        self.next_step_id = 0
        #: the full blocks of known tokens the last step computed the last
        #: position of: (request, group, block index, block, the keys it holds)
        self.completed: list[tuple[str, int, int, int, tuple]] = []
        #: what the prefix cache offered when the last step began: block
        #: contents, and the (hash, group) keys cached (a block being loaded
        #: there holds its content only once the load lands)
        #: (``OfferedAtStart`` or a frozen set, per kind of ``get_offered``)
        self.offered_at_start: tuple = (frozenset(), frozenset())
        #: the prefix cache's (key, block) entries when the last step began
        self.cached_at_start: tuple = ()

    # -- addressing ---------------------------------------------------------
    def _keeps_one_state(self, g: int) -> bool:
        """Group ``g``'s blocks hold one state each (vLLM's Mamba align mode),
        not one KV entry per position."""
        return g < len(self.groups) and self.groups[g].kind == "last_state"

    def _size(self, g: int) -> int:
        """Group ``g``'s block size."""
        return self.groups[g].block_size if g < len(self.groups) else self.block_size

    def _slot(self, g: int, blocks, pos: int) -> tuple[int, int]:
        """Where group ``g`` keeps position ``pos``: its own slot, or for a
        last-state group the block's one state (its last slot), so that every
        position written into the block replaces the same state."""
        size = self._size(g)
        slot = size - 1 if self._keeps_one_state(g) else pos % size
        return blocks[pos // size], slot

    def _write(self, g: int, blocks, pos: int, value) -> None:
        self._write_slot(*self._slot(g, blocks, pos), value)

    def _write_slot(self, b: int, s: int, value) -> None:
        """Every slot write goes through here or ``_write_run``: logged, and numbered."""
        self.slots[b][s] = value
        self._note_written(b)

    def _write_run(self, b: int, lo: int, values: list) -> None:
        """``_write_slot`` of ``values`` into block ``b`` from slot ``lo`` on, as one write."""
        self.slots[b][lo:lo + len(values)] = values
        self._note_written(b)

    def _note_written(self, b: int) -> None:
        self.changed_blocks.add(b)
        self.write_clock += 1
        self.last_write[b] = self.write_clock

    def _read(self, g: int, blocks, pos: int):
        b, s = self._slot(g, blocks, pos)
        return self.slots[b][s]

    def _is_valid(self, blocks, g: int, keys, pos: int, before=None) -> bool:
        """Position ``pos`` of group ``g`` holds its valid content. ``before``:
        slot -> value, what the reader sees of the slots it writes itself this
        step (a step reads a state before it overwrites it)."""
        index = pos // self._size(g)
        if index >= len(blocks) or blocks[index] == NULL_BLOCK:
            return False
        b, s = self._slot(g, blocks, pos)
        before = FoundByStep.of(before)
        value = before.read(self.slots[b], b, s) if before else self.slots[b][s]
        return value == get_content(g, keys, pos)

    def first_invalid(self, tables, keys, upto: int, before=None,
                      groups: set[int] | None = None, request_id: str | None = None
                      ) -> int | None:
        """The first position a step starting at ``upto`` reads, in any group
        (or in ``groups``), that does not hold valid content (None if all do):
        the groups in order, each read position in order.
        ``before``: as for ``_is_valid``. ``request_id``: whose tables these
        are; a full-attention prefix found valid for it before, and unwritten
        since, is not read again (``_get_valid_prefix``)."""
        # no position below 0 exists to read (vLLM takes a connector's negative
        # hit: a request's computed count can go below 0)
        upto = max(upto, 0)
        # the blocks read through ``before`` (what the step found there), not their slots
        before = FoundByStep.of(before)
        written = before.keys() if before else frozenset()
        for g, group in enumerate(self.groups):
            if groups is None or g in groups:
                table = tables[g] if g < len(tables) else ()
                positions = get_positions_read(group, upto)
                remember = request_id is not None and group.kind == "full_attention" \
                    and positions.start == 0 and type(keys) is list
                if remember:
                    positions = range(self._get_valid_prefix(request_id, g, table, keys,
                                                             upto, written), positions.stop)
                bad = self._first_invalid_in(g, group, table, keys, positions, before, written)
                if bad is not None:
                    return bad
                if remember:
                    self._note_valid_prefix(request_id, g, table, keys, upto, written)
        return None

    def _get_valid_prefix(self, request_id: str, g: int, table, keys, upto: int,
                          written=frozenset()) -> int:
        """Where reading must begin: the end of the prefix last found valid for
        this request and group, if its blocks still start the table, the keys
        up to it are the same (they chain: the last one names them all), and
        no block of it was written since (nor is read through ``before``: the
        blocks ``written``); else 0."""
        known = self._valid_prefix.get((request_id, g))
        if known is None:
            return 0
        end, key, blocks, clock = known
        if end > upto or end > len(keys) or keys[end - 1] != key or \
                table[:len(blocks)] != blocks or \
                max(map(self.last_write.__getitem__, blocks)) > clock:
            return 0
        if not written.isdisjoint(blocks):
            return next(i for i, b in enumerate(blocks) if b in written) * self._size(g)
        return end

    def _note_valid_prefix(self, request_id: str, g: int, table, keys, upto: int,
                           written) -> None:
        """Remember the whole blocks below ``upto`` as valid (up to the first one
        the step writes itself, ``written``: read through ``before``, not its slots)."""
        count = min(upto // self._size(g), len(table))
        if written:
            count = next((i for i in range(count) if table[i] in written), count)
        if count:
            end = count * self._size(g)
            self._valid_prefix[(request_id, g)] = (end, keys[end - 1], tuple(table[:count]),
                                                   self.write_clock)

    def _first_invalid_in(self, g: int, group: GroupSpec, blocks, keys, positions: range,
                          before, in_before) -> int | None:
        """``_is_valid`` on each of ``positions`` of group ``g``, in order: the
        first that fails. A block whose read slots are compared as one slice
        (a group keeping one entry per position, no slot of it in ``before``,
        every position within ``keys``) is judged exactly as position by
        position: its slots equal the contents ``get_content`` names; only a
        block that differs is walked position by position to name the first.
        ``in_before``: the blocks of ``before``'s slots."""
        size = group.block_size
        one_state = group.kind == "last_state"
        num_keys, num_blocks = len(keys), len(blocks)
        pos, end = positions.start, positions.stop
        while pos < end:
            index = pos // size
            block_end = min(end, (index + 1) * size)
            if index >= num_blocks or blocks[index] == NULL_BLOCK:
                return pos
            b = blocks[index]
            if not one_state and b not in in_before and block_end <= num_keys \
                    and type(keys) is list:
                want = keys[pos:block_end] if g == 0 else \
                    [(g, k) for k in keys[pos:block_end]]
                s = pos % size
                if self.slots[b][s:s + block_end - pos] == want:
                    pos = block_end
                    continue
            for p in range(pos, block_end):
                if not self._is_valid(blocks, g, keys, p, before):
                    return p
            pos = block_end
        return None

    # -- the connector's jobs (registered by the environment) ----------------
    def add_load(self, request: RequestView, block_ids, start: int, num_tokens: int,
                 is_async: bool, values: dict | None = None) -> None:
        keys = self.book.keys_of(request)
        self.loads[request.request_id] = LoadJob(
            request.request_id, tuple(tuple(t) for t in block_ids), start, num_tokens,
            is_async, keys, values)

    def cancel_load(self, request_id: str) -> None:
        job = self.loads.pop(request_id, None)
        if job is not None and job.is_async:
            self.orphaned_loads[request_id] = job

    def pending_async_loads(self) -> list[str]:
        return [rid for rid, job in self.loads.items() if job.is_async]

    def has_bad_blocks(self) -> bool:
        """Some block holds what a failed load left, or a load is still writing."""
        return bool(self.failed_blocks) or any(job.is_async for job in self.loads.values())

    def start_send(self, request_id: str, block_ids, num_tokens: int) -> None:
        """A send ships the full-attention group's KV (``block_ids``: its table):
        per slot, what it holds now and the valid content of its position."""
        keys = self.book.get_known(request_id)
        self.sends[request_id] = {
            self._slot(0, block_ids, p): (self._read(0, block_ids, p), get_content(0, keys, p))
            for p in range(num_tokens)}

    def finish_send(self, request_id: str) -> None:
        self.sends.pop(request_id, None)

    # -- one step of the worker ---------------------------------------------
    def execute(self, step: StepView, obs: Observation, finish_async: set[str],
                fail: set[str], fail_offset: int, fail_blocks: int = 1,
                pending: dict[str, tuple[int, ...]] | None = None,
                fail_group: int = 0) -> ExecReport:
        """Run one step: finished async loads, sync loads, then the compute.
        ``pending``: per request, the tokens steps in flight sampled that the
        scheduler has not seen yet (the worker feeds them to this step)."""
        report = ExecReport()
        report.step_id = self.next_step_id
        self.next_step_id += 1
        self.in_flight[report.step_id] = []
        for rid in [r for r in finish_async if r in self.loads and self.loads[r].is_async]:
            self._run_load(self.loads.pop(rid), rid in fail, fail_offset, fail_blocks, report,
                           fail_group)
            report.finished_recving.add(rid)
            if rid not in fail:
                report.loaded_ok.add(rid)
        for rid in step.num_scheduled_tokens:
            job = self.loads.get(rid)
            if job is not None and not job.is_async:
                self._run_load(self.loads.pop(rid), rid in fail, fail_offset, fail_blocks,
                               report, fail_group)
        self._compute(step, obs, report, pending or {})
        self.unreported[report.step_id] = set(report.invalid_block_ids) | {
            b for rid in report.garbage_readers for b in _held(obs.requests[rid])}
        self.changed_blocks.extend(self.unreported[report.step_id])
        return report

    def get_unreported_blocks(self) -> set[int]:
        """Blocks made bad by a step whose output (and failure report) is still
        in flight."""
        return set().union(*self.unreported.values()) if self.unreported else set()

    def complete(self, step_id: int) -> None:
        """A step's output is back: its writes land again over every slot no
        later step has written since (a load not ordered with the stream that
        wrote there in between is lost)."""
        self.changed_blocks.extend(self.unreported.pop(step_id, ()))
        for b, lo, values in self.in_flight.pop(step_id, ()):
            writers, hi = self.stream_writer[b], lo + len(values)
            if writers[lo:hi].count(step_id) == hi - lo:
                self._write_run(b, lo, values)
                continue
            for s in range(lo, hi):
                if writers[s] == step_id:
                    self._write_slot(b, s, values[s - lo])

    def _run_load(self, job: LoadJob, failing: bool, fail_offset: int, fail_blocks: int,
                  report: ExecReport, fail_group: int = 0) -> None:
        """A failing load leaves garbage in ``fail_blocks`` consecutive blocks of
        group ``fail_group`` (wrapped into the groups there are) from the one at
        ``fail_offset`` among the blocks the load writes there: one bad block,
        or a transfer that broke off and lost the rest."""
        g_bad = fail_group % len(self.groups)
        for g, group in enumerate(self.groups):
            table = job.block_ids[g] if g < len(job.block_ids) else ()
            positions = self._load_positions(group, table, job)
            written = sorted({pos // group.block_size for pos in positions})
            bad = set()
            if failing and g == g_bad and written:
                start = fail_offset % len(written)
                bad = set(written[start:start + max(fail_blocks, 1)])
            for pos in positions:  # in order: a last-state block keeps the last one's state
                ok = pos // group.block_size not in bad
                self._write(g, table, pos, self._loaded(job, g, pos) if ok else GARBAGE)
            for index in sorted(bad):
                report.invalid_block_ids.add(table[index])
                self.failed_blocks.add(table[index])

    @staticmethod
    def _loaded(job: LoadJob, g: int, pos: int):
        """What a load brings for one position: what the store held."""
        if job.values is None or g:
            return get_content(g, job.keys, pos)
        return job.values.get(pos, GARBAGE)

    def read_stored(self, block_ids, num_tokens: int) -> dict:
        """What a store reading group 0's ``block_ids`` takes now, per position."""
        return {p: self._read(0, block_ids, p) for p in range(num_tokens)
                if p // self._size(0) < len(block_ids)}

    def _load_positions(self, group: GroupSpec, table, job: LoadJob) -> list[int]:
        """Positions a load writes in one group: those the group holds blocks
        for (into a last-state block the load leaves the state after the last
        position it loaded there)."""
        return [p for p in range(job.start, job.start + job.num_tokens)
                if p // group.block_size < len(table)
                and table[p // group.block_size] != NULL_BLOCK]

    def _compute(self, step: StepView, obs: Observation, report: ExecReport,
                 pending: dict[str, tuple[int, ...]]) -> None:
        writes = self._plan_writes(step, obs, pending)
        runs = {rid: self._get_step_runs(tables, keys, start, n)
                for rid, (tables, keys, start, n) in writes.items()}
        # taken before any write: a last-state read sees the state the step found
        before = {rid: self._found_by_step(runs[rid]) for rid in writes}
        self._apply_writes(runs, obs)
        self.completed = [done for rid, (tables, keys, start, n) in writes.items()
                          for done in self._completed_blocks(rid, obs.requests[rid], tables,
                                                             keys, start, n)]
        self._spread_garbage(writes, runs, before, report)
        self._record_stream_writes(runs, report.step_id)

    def _plan_writes(self, step: StepView, obs: Observation,
                     pending: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
        """Per scheduled request: (tables, prefix keys of what it computes, start, count)."""
        writes = {}
        for rid, n in step.num_scheduled_tokens.items():
            req = obs.requests[rid]
            keys = self.book.keys_of(req)
            # tokens in flight and drafts: keys past the known ones (on a copy)
            extra = pending.get(rid, ()) + tuple(step.scheduled_spec_decode_tokens.get(rid, ()))
            if extra:
                keys = list(keys)
                append_prefix_keys(keys, extra, keys[-1] if keys else 0)
            start = step.num_computed_before[rid]
            # a step cannot write below position 0: vLLM takes a connector's
            # negative hit and schedules from there (``schedule_relation`` and
            # the contract judge that; the worker computes what exists)
            writes[rid] = (req.block_ids, keys, max(start, 0), n + min(start, 0))
        return writes

    def _apply_writes(self, runs: dict[str, list], obs: Observation) -> None:
        """Every scheduled position's content, in order (a last-state block
        ends with its last position's state); slots two requests write are
        recorded, and failed blocks written again are no longer failed."""
        writers: dict[int, list | tuple] = {}
        self.double_writes = []
        recomputed = set()
        for rid, request_runs in runs.items():
            for b, lo, values in request_runs:
                self._write_run(b, lo, values)
                if b in self.failed_blocks:
                    recomputed.add(b)
                self._claim_slots(writers, b, lo, lo + len(values), rid)
        if recomputed:
            holders = _count_holders(obs)
            self.shared_recomputes = sum(holders.get(b, 0) >= 2 for b in recomputed)
        else:
            self.shared_recomputes = 0
        self.failed_blocks -= recomputed

    def _claim_slots(self, writers: dict[int, list | tuple], b: int, lo: int, hi: int,
                     rid: str) -> None:
        """``rid`` writes slots ``[lo, hi)`` of block ``b`` this step: a slot
        another request wrote first is a double write (``double_writes``)."""
        mine = writers.get(b)
        if mine is None:  # the block's first writer this step: its run alone
            writers[b] = (rid, lo, hi)
            return
        if type(mine) is tuple:  # a second writer: the first one's slots, one by one
            first, first_lo, first_hi = mine
            mine = writers[b] = [None] * self.block_size
            mine[first_lo:first_hi] = [first] * (first_hi - first_lo)
        for s in range(lo, hi):
            first = mine[s]
            if first is None:
                mine[s] = rid
            elif first != rid:
                self.double_writes.append((b, s, first, rid))

    def _spread_garbage(self, writes: dict[str, tuple], runs: dict[str, list],
                        before: dict[str, dict], report: ExecReport) -> None:
        """A request that read invalid content writes garbage, to a fixed point."""
        changed = True
        while changed:
            changed = False
            for rid, (tables, keys, start, _n) in writes.items():
                bad = self.first_invalid(tables, keys, start, before[rid], request_id=rid)
                if bad is None or rid in report.garbage_readers:
                    continue
                report.garbage_readers[rid] = bad
                for b, lo, values in runs[rid]:
                    self._write_run(b, lo, [GARBAGE] * len(values))
                    report.garbage_blocks.add(b)
                changed = True

    def _completed_blocks(self, rid: str, req: RequestView, tables, keys, start: int, n: int):
        """The blocks a step computing ``[start, start + n)`` made worth caching:
        full blocks a prefix hit can read (``is_block_reachable``) that end
        where a hit may end, or before it, once the step computed on to that
        end (``scheduler_block_size``), within the tokens the scheduler knows
        (not a draft, not a token in flight)."""
        align = self.scheduler_block_size
        lo = start // align * align
        hi = min(start + n, req.num_tokens) // align * align
        for g, table in enumerate(tables):
            size = self._size(g)
            for index in range(lo // size, min(hi // size, len(table))):
                if table[index] != NULL_BLOCK and self._is_read_by_a_hit(g, index):
                    yield rid, g, index, table[index], tuple(keys[index * size:
                                                                  (index + 1) * size])

    def _is_read_by_a_hit(self, g: int, index: int) -> bool:
        """Block ``index`` of group ``g`` holds a position a step resuming from
        a prefix hit reads. Hits end on multiples of the scheduler block, and a
        block's only chance is the first such end at or past its own (a later
        one reads later positions)."""
        align = self.scheduler_block_size
        hit_end = -(-(index + 1) * self._size(g) // align) * align
        return index in get_blocks_read(self.groups[g], hit_end)

    def _found_by_step(self, runs: list) -> "FoundByStep":
        """What the slots a step writes (``_get_step_runs``) held before its
        compute: a last-state read of the block the step goes on writing
        (resuming mid-block) sees the state there, not the step's own."""
        found = FoundByStep()
        for b, lo, values in runs:
            found.take(self.slots[b], b, lo, lo + len(values))
        return found

    def _get_step_runs(self, tables, keys, start: int, n: int) -> list[tuple[int, int, list]]:
        """(block, first slot, contents) of every run of slots a step computing
        ``[start, start + n)`` writes: per group, per block that its table
        holds, in position order, the contents ``get_content`` names (a
        last-state block: its one state, the last position's)."""
        runs = []
        end = start + n
        for g, table in enumerate(tables if n > 0 else ()):
            size, one_state = self._size(g), self._keeps_one_state(g)
            for index in range(start // size, min(-(-end // size), len(table))):
                b = table[index]
                if b == NULL_BLOCK:
                    continue
                lo, hi = max(start, index * size), min(end, (index + 1) * size)
                if one_state:  # the block's one state: its last position's
                    lo = hi - 1
                runs.append((b, self._slot(g, table, lo)[1], get_contents(g, keys, lo, hi)))
        return runs

    def _record_stream_writes(self, runs: dict[str, list], step_id: int) -> None:
        """The step is the last to write its slots in stream order, and what
        they hold now is what lands again when it completes."""
        mine = self.in_flight[step_id]
        for request_runs in runs.values():
            for b, lo, values in request_runs:
                hi = lo + len(values)
                writers = self.stream_writer.get(b)
                if writers is None:
                    writers = self.stream_writer[b] = [None] * self.block_size
                writers[lo:hi] = [step_id] * (hi - lo)
                mine.append((b, lo, self.slots[b][lo:hi]))

    # -- checks ---------------------------------------------------------------
    def learn(self, obs: Observation) -> None:
        """Record what each block hash names, from the requests' hash chains."""
        size, span = self.hash_block_size, self.block_size
        for r in obs.requests.values():
            hashes = r.block_hashes
            # the hashes it had at the last call, all known then: only later ones are news
            seen = self._hashes_seen.get(r.request_id, ())
            if hashes == seen:
                continue
            start = len(seen) if hashes[:len(seen)] == seen else 0
            keys = self.book.keys_of(r)
            done = len(hashes)
            for i in range(start, len(hashes)):
                h, end = hashes[i], (i + 1) * size
                if h in self.expected_by_hash:
                    continue
                if end > len(keys):  # named past the known tokens: not yet
                    done = min(done, i)
                    continue
                # the hash names the prefix up to ``end``: a group's block
                # named by it holds the keys from the block's start to it
                self.expected_by_hash[h] = (end, tuple(keys[max(0, end - span):end]))
                self.learned_hashes.add(h)
            self._hashes_seen[r.request_id] = tuple(hashes[:done])

    def loading_blocks(self, held_requests=frozenset()) -> set[int]:
        """Blocks an async load in flight is still writing: the loads under way,
        and the orphaned loads of ``held_requests`` (ended requests the scheduler
        holds, waiting for the worker's report of their load)."""
        jobs = [*self.loads.values(),
                *(job for rid, job in self.orphaned_loads.items() if rid in held_requests)]
        return {b for job in jobs if job.is_async for b in self._load_targets(job)}

    def _load_targets(self, job: LoadJob) -> set[int]:
        if job.num_tokens <= 0:
            return set()
        end = job.start + job.num_tokens - 1
        return {b for g, table in enumerate(job.block_ids)
                for b in table[job.start // self._size(g):end // self._size(g) + 1]
                if b != NULL_BLOCK}

    def check_cache(self, obs: Observation, blocks=None) -> Iterator[str]:
        """``is_cached_block_valid`` on every prefix-cache entry (on those naming
        ``blocks``, when given), with the valid and loading bits the pool proof
        reasons about."""
        loading = self.loading_blocks()
        unreported = self.get_unreported_blocks()
        slots, wants = self.slots, self._wants_by_key
        for key, block in _get_entries_of(obs.pool.cached, blocks):
            want = wants.get(key)
            if want is not None and want[0]:  # ``holds_named`` of a full-attention-like group
                valid = slots[block][:len(want[1])] == want[1]
            else:
                block_hash, g = split_cache_key(key)
                valid = self.holds_named(block, g, block_hash)
                if valid is not None and g < len(self.groups):
                    wants[key] = (self.groups[g].kind != "last_state",
                                  self._named_wants[(block_hash, g)])
            if valid is None or block in unreported:
                continue
            # valid and not loading: the predicate holds (Implies(True, And(True, Not(False))))
            if (not valid or block in loading) and \
                    not is_cached_block_valid(True, valid, block in loading):
                why = "an async load is still writing it" if valid else \
                    "it does not hold the content its hash names"
                yield f"block {block} is in the prefix cache but {why}"

    def holds_named(self, block: int, g: int, block_hash) -> bool | None:
        """The block holds what ``block_hash`` names in group ``g`` (None: a
        hash no request has shown, or a group the oracle lacks)."""
        want = self._named_wants.get((block_hash, g))
        if want is None:
            named = self.expected_by_hash.get(block_hash)
            if named is None or g >= len(self.groups):
                return None
            # what a hash names never changes once learnt (``learn`` keeps the first)
            want = self._named_wants[(block_hash, g)] = self._want(
                g, self._get_named_keys(g, *named))
        return self._holds_want(block, g, want)

    def _get_named_keys(self, g: int, end: int, tail: tuple) -> tuple:
        """The keys a block of group ``g`` cached under a hash naming the
        prefix up to ``end`` holds: from the block's start to ``end``. Short
        of a whole block for a partial entry (vLLM caches the block holding a
        prompt's last hash boundary under that boundary's hash too, when the
        group's blocks are larger than its hash blocks)."""
        start = (end - 1) // self._size(g) * self._size(g)
        return tail[len(tail) - (end - start):]

    def _holds_want(self, block: int, g: int, want: list) -> bool:
        """The block holds the slots ``want`` (``_want``) as group ``g`` keeps
        them: every slot (the first ones, for a partial entry), or for a
        last-state group the state at its end."""
        size = self._size(g)
        if self.groups[g].kind == "last_state":
            return len(want) == size and self.slots[block][size - 1] == want[-1]
        return self.slots[block][:len(want)] == want

    def _want(self, g: int, expected: tuple) -> list:
        """The slots of a block of group ``g`` holding the last of ``expected``."""
        tail = expected[-self._size(g):]
        return get_contents(g, tail, 0, len(tail))

    def forget_completed(self) -> None:
        """The step's completed blocks were judged: later evictions and resets
        are the cache's policy, not a block left uncached."""
        self.completed = []

    def has_outstanding_failure(self) -> bool:
        """A failed load's garbage not yet recomputed, or not yet reported."""
        return bool(self.failed_blocks or self.get_unreported_blocks())

    def get_offered(self, obs: Observation) -> tuple[Counter, Counter]:
        """What the prefix cache offers, by content: every cached block's slots
        (its first ``block_size`` of each group), and its last slot (all a
        last-state group keeps; counted only where a group is one), each with
        how many blocks offer it (never 0). Kept up to date block by block: a
        block is read again only when it enters the cache or is written. Live
        books: read them before the next call."""
        known, contents, lasts = self._offered_books()
        books, log = self._offered, self.changed_blocks
        # the log kept every write since the last call only if it was on then
        logged = books.get("logged") and books["mark"] >= log.offset
        written = known.keys() & set(log.since(books["mark"])) if logged else None
        if books.get("entries") is obs.pool.cached and logged:
            # the very entries of the last call (``known`` holds their blocks):
            # only a block written since is read again
            blocks, stale = None, written
        else:
            blocks = get_cache_index(obs.pool.cached).by_block.keys()
            stale = (known.keys() - blocks) | written if logged else \
                [b for b, seen in known.items() if b not in blocks or seen[0] != self.last_write[b]]
        undo = self._get_start_undo(contents, lasts)
        # the last slots are read only for a last-state group (``_is_offered``)
        keep_lasts = any(map(self._keeps_one_state, range(len(self.groups))))
        for b in stale:
            _clock, tuples, last = known.pop(b)
            _count(contents, tuples, -1, undo[0])
            if keep_lasts:
                _count(lasts, (last,), -1, undo[1])
        new = stale if blocks is None else blocks - known.keys()
        books.update(entries=obs.pool.cached, mark=log.offset + len(log.items),
                     logged=log.active)
        sizes = sorted({g.block_size for g in self.groups})
        for b in new:
            tuples, last = [tuple(self.slots[b][:size]) for size in sizes], self.slots[b][-1]
            known[b] = (self.last_write[b], tuples, last)
            _count(contents, tuples, 1, undo[0])
            if keep_lasts:
                _count(lasts, (last,), 1, undo[1])
        return contents, lasts

    def _get_start_undo(self, contents: Counter, lasts: Counter) -> tuple:
        """Per kind, where ``get_offered`` notes a count's value at the step's
        start before changing it: the ``OfferedAtStart`` reading these very
        books (None: the step's start is frozen, or read other books)."""
        return tuple(view.undo if type(view) is OfferedAtStart and view.live is live else None
                     for view, live in zip(self.offered_at_start, (contents, lasts)))

    def _offered_books(self) -> tuple[dict, Counter, Counter]:
        """``get_offered``'s books (a cache: a copy starts them again): per cached
        block, its last write and contents when read; how many blocks offer each."""
        if not self._offered:
            self._offered.update(known={}, contents=Counter(), lasts=Counter())
        return self._offered["known"], self._offered["contents"], self._offered["lasts"]

    def note_step_start(self, obs: Observation) -> None:
        """A step begins: what the cache offers now (a block computed again over
        a copy the cache held is not the scheduler's to cache twice)."""
        self.offered_at_start = tuple(map(OfferedAtStart, self.get_offered(obs)))
        self.cached_at_start = obs.pool.cached

    def _was_key_cached(self, block_hash, g: int) -> bool:
        """Some key the cache held when the step began names ``block_hash`` in
        group ``g`` (``split_cache_key`` of it is ``(block_hash, g)``)."""
        keys = get_key_index(self.cached_at_start)
        if (GROUP_KEY, g, block_hash) in keys:
            return True
        return g == 0 and not is_group_cache_key(block_hash) and block_hash in keys

    def _was_offered(self, r: RequestView, g: int, index: int, want: list) -> bool:
        """A copy was in the cache when the step began: by content, or by the
        key of this block of the request (its copy's load may not have landed)."""
        # the hash naming the prefix up to the block's end (hashes chain)
        h = (index + 1) * self._size(g) // self.hash_block_size - 1
        return self._is_offered(self.offered_at_start, g, want) or \
            h < len(r.block_hashes) and self._was_key_cached(r.block_hashes[h], g)

    def _is_offered(self, offered: tuple, g: int, want: list) -> bool:
        """Content ``want`` (``_want``) is among ``offered`` (``get_offered``'s kinds)."""
        if self.groups[g].kind == "last_state":
            return want[-1] in offered[1]
        return tuple(want) in offered[0]

    def check_completed_cached(self, obs: Observation) -> Iterator[str]:
        """``computed_blocks_are_cached``: each full block the last step
        completed with valid content, still held by its running request, is
        findable in the prefix cache: some cached block (under any key) holds
        that content as its group keeps it, unless a copy was cached when the
        step began (the cache's eviction order decides whether it stays). Not
        judged while a load failure is outstanding: which cached hashes a
        recovery drops as suspect is the scheduler's trade (a hit at most)."""
        if not self.completed or self.has_outstanding_failure():
            return
        offered = self.get_offered(obs)
        for rid, g, index, block, expected in self.completed:
            want = self._want(g, expected)
            if self._is_offered(offered, g, want):  # the usual case: it was cached
                continue
            r = obs.requests.get(rid)
            if r is None or r.status != RequestStatus.RUNNING or \
                    g >= len(r.block_ids) or r.block_ids[g][index:index + 1] != (block,) or \
                    not self._holds_want(block, g, want) or self._was_offered(r, g, index, want):
                continue
            yield (f"{rid}: block {block} (index {index}, group {g}) holds computed "
                   "content no prefix-cache entry offers: a later request with this "
                   "prefix recomputes it")

    def check_request(self, obs: Observation, r: RequestView) -> Iterator[str]:
        """Every real computed token (``num_computed_tokens`` less the output
        placeholders of steps in flight) holds valid KV."""
        if self.unreported and self.get_unreported_blocks() & _held(r):
            return  # a failure the scheduler has not been told of yet
        keys = self.book.keys_of(r)
        real = min(r.num_computed_tokens - r.num_output_placeholders, len(keys))
        bad = self.first_invalid(r.block_ids, keys, real,
                                 groups=self._judged_groups(real, r.num_computed_tokens),
                                 request_id=r.request_id)
        if bad is not None:
            yield (f"{r.request_id}: token {bad} is counted as computed "
                   f"(num_computed={r.num_computed_tokens}) but its KV is not valid")

    def _judged_groups(self, real: int, computed: int) -> set[int]:
        """The groups whose reads from ``real`` are judged when ``computed``
        positions are: every group, but a last-state group only while its
        block still holds the state after ``real`` tokens. A step in flight
        that computed on into the same block replaced it with the state after
        a token the scheduler has not seen yet (a placeholder); the step that
        reads that state is judged when it runs (``garbage_readers``)."""
        return {g for g in range(len(self.groups)) if not self._keeps_one_state(g)
                or real == computed or real % self._size(g) == 0}

    def check_single_writer(self) -> Iterator[str]:
        for block, slot, first, second in self.double_writes[:1]:
            yield (f"block {block} slot {slot} was computed by both {first} and {second} "
                   f"in the same step")

    def check_sends(self) -> Iterator[str]:
        """A send's slots hold what they held when it began, or the valid
        content of their positions: a slot that held garbage then (a failed
        load its request ended before the failure was reported) may be
        recomputed in place by another holder of the block the failure cut
        back, which repairs what the send ships."""
        for rid, snapshot in self.sends.items():
            for (b, s), (value, valid) in snapshot.items():
                now = self.slots[b][s]
                if now != value and now != valid:
                    yield f"{rid}: block {b} was overwritten while its KV was being sent"
                    break
