"""The invariant catalogue for one full-attention KV cache group.

Each invariant is a predicate on the observed state (plus ghost history where
a property needs it); its docstring says what it protects and which upstream
issue shows the cost of breaking it. ``docs/spec.md`` is generated from here.

Scope notes. "While running" means status RUNNING. ``num_computed_tokens`` of a
request in WAITING_FOR_REMOTE_KVS is the *target* of its in-flight load, not
valid KV yet, so the "computed means valid" family excludes that status.
"""
from __future__ import annotations

from collections import Counter
from itertools import chain
from typing import Iterable, Iterator

import attrs

from kvspec.spec.arith import compute_first_external
from kvspec.spec.cache_index import get_cache_index
from kvspec.spec.groups import NULL_BLOCK, split_cache_key
from kvspec.spec.history import Ghost
from kvspec.spec.predicates import (is_blocks_cover_computed, is_cached_le_computed,
                                    is_computed_within_tokens, is_free_iff_unreferenced,
                                    is_load_target_held, is_placeholders_nonnegative,
                                    is_preempted_counted,
                                    is_ref_count_of_holders, is_stats_ordered,
                                    is_unscheduled_without_output, is_waiting_with_work)
from kvspec.spec.arith import compute_real_computed
from kvspec.spec.reads import get_blocks_read, get_positions_read
from kvspec.spec.registry import DerivedByIdentity, Memo, Witnessing, invariant
from kvspec.spec.scope import Scope
from kvspec.spec.state import Observation, RequestStatus, RequestView
from kvspec.spec.table_tally import get_table_tally


@attrs.define
class Context(Witnessing):
    obs: Observation
    ghost: Ghost
    oracle: object | None = None  # kvspec.spec.oracle.KVContent when synced
    #: False between schedule() and update_from_output(): computed counts then
    #: include the tokens (and drafts) of the step in flight
    synced: bool = True
    #: True right after a step's update_from_output: what the worker did in that
    #: step (double writes, recomputes) is this state's news, not an older step's
    after_step: bool = False
    #: an incremental check: the requests and blocks that changed since the
    #: claims last held (None: a full check, everything is judged)
    scope: Scope | None = None
    #: the scope of the claim being judged (set by the checker): what
    #: ``live``, ``requests`` and ``blocks`` narrow to under ``scope``
    judging: str = "all"

    witnessed: int = 0
    #: what several claims derive from the observation, derived once per Context
    #: (claims are pure: the observation does not change while they judge it)
    memo: Memo = attrs.field(factory=Memo, init=False, repr=False, eq=False)

    def live(self) -> Iterator[RequestView]:
        """The live requests (in an incremental check of a request claim, the changed ones)."""
        key = "changed live" if self.is_narrowed("request") else "live"
        live = self.memo.get(key)
        if live is None:
            live = self.memo[key] = [r for r in self.requests() if not r.status.is_finished]
        return iter(live)

    def requests(self) -> Iterator[RequestView]:
        """Every request the scheduler holds, finished ones too (narrowed as ``live``)."""
        if not self.is_narrowed("request"):
            return iter(self.obs.requests.values())
        changed = self.memo.get("changed")
        if changed is None:
            wanted, requests = self.scope.requests, self.obs.requests
            changed = self.memo["changed"] = [requests[rid] for rid in requests
                                              if rid in wanted]
        return iter(changed)

    def blocks(self) -> Iterable[int]:
        """Every block id (in an incremental check of a block claim, the changed ones)."""
        if not self.is_narrowed("block"):
            return range(self.obs.pool.num_blocks)
        blocks = self.memo.get("blocks")
        if blocks is None:
            num = self.obs.pool.num_blocks
            blocks = self.memo["blocks"] = [b for b in sorted(self.scope.blocks) if 0 <= b < num]
        return blocks

    def is_narrowed(self, scope: str) -> bool:
        return self.scope is not None and self.judging == scope

    def holders(self) -> list[int]:
        """References per block (``_holders``), counted once."""
        holders = self.memo.get("holders")
        if holders is None:
            holders = self.memo["holders"] = _holders(self)
        return holders

    def is_undisturbed(self, r: RequestView) -> bool:
        """Never preempted and never touched by a load failure: its stats still
        describe the prefix it runs on."""
        return r.num_preemptions == 0 and r.request_id not in self.ghost.recovered


def _blocks(req: RequestView) -> tuple[int, ...]:
    return req.block_ids[0] if req.block_ids else ()


def get_real_computed(r: RequestView) -> int:
    """Computed positions whose tokens are known: under async scheduling
    ``num_computed_tokens`` runs ahead by the placeholders of steps in flight."""
    return compute_real_computed(r.num_computed_tokens, r.num_output_placeholders)


# -- cache-hit stats ----------------------------------------------------------

@invariant(cites="#36533, #36755, #36859", scope="request")
def stats_are_ordered(ctx: Context):
    """Cache-hit stats are ordered: ``prompt_len >= num_cached >= num_external >= 0``.

    Protects the derived metric ``local_cache_hit = num_cached - num_external``:
    when it went negative, Prometheus' counter raised and crashed the server
    (#36533); the cause was ``num_external_computed_tokens`` re-set on a
    re-scheduling while ``num_cached_tokens`` was kept (#36859)."""
    for r in ctx.live():
        ctx.witness(r.has_stats)
        if r.has_stats and not is_stats_ordered(r.num_prompt_tokens, r.num_cached_tokens,
                                                r.num_external_computed_tokens):
            yield (f"{r.request_id}: prompt_len={r.num_prompt_tokens} num_cached="
                   f"{r.num_cached_tokens} num_external={r.num_external_computed_tokens}")
        elif not r.has_stats and r.num_external_computed_tokens < 0:
            yield f"{r.request_id}: num_external={r.num_external_computed_tokens} < 0"


@invariant(cites="#36859, #37460", scope="request")
def stats_set_exactly_once(ctx: Context):
    """Cache-hit stats are set exactly once, at the first scheduling (or when an
    async load is issued), and never re-set by preemption or a failed
    allocation; only failure recovery may change them, and only by lowering
    them in a way that keeps them ordered (``is_admissible_lowering``: both
    together, the external count only, or not at all are all correct choices).

    Protects the meaning of the stats (the hits of the request's first prefill)
    that the frontend reports once. Re-setting one of the pair on a
    re-scheduling is what made the pair inconsistent in #36859. On vLLM from
    0.32 the request's ``prefill_stats`` are recorded again at each lookup
    until the request first runs (after a failed allocation or a failed async
    load too, with possibly higher counts), so kvspec reads them as set when
    the request first runs (``vllm_observe``: final from RUNNING on), the
    values the frontend is handed. Witnessed by a
    request with recorded stats that has since been preempted or cut back by a
    load failure: the events a scheduler could re-set them on."""
    for r in ctx.live():
        first = ctx.ghost.stats.get(r.request_id)
        if first is not None and not ctx.is_undisturbed(r):
            ctx.witness()
        if first is None or not r.has_stats:
            if first is not None:
                yield f"{r.request_id}: stats were set to {first}, now unset"
            continue
        now = (r.num_cached_tokens, r.num_external_computed_tokens)
        if now != first:
            yield (f"{r.request_id}: stats set to {first}, changed to {now}; only failure "
                   f"recovery may change them, by an ordered lowering")


@invariant(cites="#36533, #36755 (seed 001)", scope="request")
def stats_are_the_first_hits(ctx: Context):
    """The external part of the stats is what the connector answered at the first
    scheduling, less what that scheduling did not count as computed
    (``compute_first_external`` of the recorded ``num_cached_tokens``), unless a
    load failure has touched the request since (recovery lowers it).

    Protects what operators read as the external cache's hit rate: the bounds
    alone (ordered, set once) admit any external count up to the cached one, so a
    scheduler could under- or over-report the connector's hits and no other
    claim would notice. (``num_cached_tokens`` itself is pinned by
    ``schedule_relation``: the computed prefix the first scheduling starts from.)"""
    for r in ctx.live():
        first, hits = ctx.ghost.stats.get(r.request_id), ctx.ghost.first_hits.get(r.request_id)
        if first is None or hits is None or r.request_id in ctx.ghost.recovered:
            continue
        ctx.witness(hits[1] > 0)  # the connector had hits to report
        expected = compute_first_external(first[0], hits[0], hits[1])
        if first[1] != expected:
            yield (f"{r.request_id}: {first[1]} external hits recorded, but the connector "
                   f"answered {hits[1]} beyond {hits[0]} local for {first[0]} cached: {expected}")


@invariant(cites="#34616", scope="request")
def running_request_has_stats(ctx: Context):
    """A RUNNING request has its cache-hit stats set.

    Protects the stats of async-loaded requests: before #34616 a request whose
    KV came by an async load never set ``num_cached_tokens``."""
    for r in ctx.live():
        if r.status == RequestStatus.RUNNING:
            ctx.witness()
            if not r.has_stats:
                yield f"{r.request_id} is RUNNING with num_cached_tokens unset"


@invariant(cites="#36859 (stats set at the first scheduling)", scope="request")
def unscheduled_request_has_no_output(ctx: Context):
    """A request that has not run has no output tokens: one whose stats are
    unset (never scheduled), or one waiting that was never preempted (only a
    preemption sends a request that ran back to wait).

    The strengthenings the Z3 induction needed: without them, "first
    scheduling" could see a request with outputs, and the stats' bound by the
    prompt length is not inductive. They protect the meaning of "first scheduling"."""
    for r in ctx.live():
        waiting = r.status.is_waiting or r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        unpreempted_waiting = waiting and r.num_preemptions == 0
        ctx.witness(not r.has_stats or unpreempted_waiting)
        if not is_unscheduled_without_output(r.has_stats, unpreempted_waiting, r.num_tokens,
                                             r.num_prompt_tokens):
            yield f"{r.request_id} has {len(r.output_token_ids)} output tokens but has not run"


@invariant(cites="#34616, #36859", scope="request")
def cached_le_computed(ctx: Context):
    """Tokens reported as cache hits were computed: ``num_cached_tokens <=
    num_computed_tokens`` for a RUNNING request, and all but the last token
    (which a full-prompt hit recomputes) for one waiting with its load finished
    or in flight; for a request never preempted and never touched by a load
    failure.

    Scope: after a preemption ``num_computed_tokens`` restarts from the hits of
    the re-scheduling, which may be fewer than the first time, while the stats
    keep the first scheduling's value; after a load failure a scheduler may keep
    the stats (vLLM 0.32 does) while it recomputes. Protects the stats' meaning.

    Under async scheduling the bound is the positions scheduled, steps in flight
    included (as a synchronous step under way counts its own): a full-prompt hit
    recomputes its last token in the step in flight, while its placeholder
    already counts against the real boundary."""
    for r in ctx.live():
        if not (r.has_stats and ctx.is_undisturbed(r)):
            continue
        running = r.status == RequestStatus.RUNNING
        waiting = r.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS)
        ctx.witness(running or waiting)
        if not is_cached_le_computed(running, waiting, r.num_cached_tokens,
                                     r.num_computed_tokens, r.num_tokens):
            yield (f"{r.request_id} ({r.status.name}): num_cached={r.num_cached_tokens} > "
                   f"num_computed={r.num_computed_tokens}")


# -- token accounting ---------------------------------------------------------

@invariant(cites="#34616, #27644", scope="request")
def computed_within_tokens(ctx: Context):
    """``0 <= num_computed_tokens - num_output_placeholders <= num_tokens``
    between steps (under async scheduling the placeholders of steps in flight
    are positions whose tokens are not known yet); within a step, when the
    scheduled drafts count too, only the lower bound is judged (the upper is
    ``num_tokens + max_model_len``, no real bound), and a waiting request
    whose KV has arrived leaves at least one token to compute.

    Protects the model runner: it cannot run a request with nothing scheduled,
    so a full-prompt hit must recompute the last token (the rule #34616 kept).
    Witnessed by a live request with computed tokens."""
    for r in ctx.live():
        ctx.witness(r.num_computed_tokens > 0)
        upper = r.num_tokens if ctx.synced else r.num_tokens + ctx.obs.config.max_model_len
        if not is_computed_within_tokens(get_real_computed(r), upper):
            yield (f"{r.request_id}: num_computed={r.num_computed_tokens} "
                   f"(placeholders {r.num_output_placeholders}) of {r.num_tokens} tokens")
        elif not is_waiting_with_work(
                r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED),
                r.num_computed_tokens, r.num_tokens):
            yield f"{r.request_id}: waiting with all {r.num_tokens} tokens computed"


@invariant(cites="#27644, #47900, #48245", scope="request")
def placeholders_nonnegative(ctx: Context):
    """``num_output_placeholders >= 0``.

    Protects async scheduling: a connector sees ``num_computed_tokens -
    num_output_placeholders`` as the real boundary (#27644); a negative count
    (output of a preempted request decrementing counters the preemption reset,
    #47900, #48245) moves that boundary past the known tokens. Witnessed by a
    request with placeholders."""
    for r in ctx.live():
        ctx.witness(r.num_output_placeholders != 0)
        if not is_placeholders_nonnegative(r.num_output_placeholders):
            yield f"{r.request_id}: num_output_placeholders={r.num_output_placeholders}"


@invariant(cites="#27644, #47900, #48245", scope="request")
def placeholders_match_in_flight(ctx: Context):
    """Between steps, a live request's ``num_output_placeholders`` is exactly the
    tokens its steps in flight will sample and have not delivered: one per
    sampling step (plus its drafts) when scheduled, returned with its output,
    none after a preemption, whose output in flight is stale. Prefill chunks
    sample nothing and own none. Counted by the harness as those shares, not with
    ``spec/arith.py``'s placeholder rules, which the reference uses.

    Protects the real boundary ``num_computed_tokens - num_output_placeholders``
    that the prefix cache, a connector's store and the max-tokens check use: too
    few and a position no token fills yet counts as real (#27644: the count
    read before its increment); too many and real KV is held back; a preemption
    that keeps them, or stale output that decrements them, drifts the count for
    the rest of the request (#47900, #48245). Witnessed by a request with
    placeholders."""
    if not ctx.synced:
        return
    for r in ctx.live():
        want = ctx.ghost.placeholders.get(r.request_id, 0)
        ctx.witness(want > 0)
        if r.num_output_placeholders != want:
            yield (f"{r.request_id} ({r.status.name}): num_output_placeholders="
                   f"{r.num_output_placeholders}, but its steps in flight will sample {want}")


@invariant(cites="#36755, #47900, #48141", scope="request")
def output_is_the_sampled_sequence(ctx: Context):
    """Each output token is a token the worker sampled at that position: none
    lost, none delivered twice, none shifted, across preemptions with output in
    flight (delivered late, or dropped and sampled again).

    Protects what the user reads: under async scheduling a request preempted
    with a step in flight gets that step's output after it was reset; a
    scheduler that resumes it before the output drains, or applies the output
    to the reset counters, appends a position twice or skips one. Witnessed by
    a request whose output a preemption interrupted."""
    checked = ctx.ghost.checked_outputs
    for r in ctx.requests():
        sampled = ctx.ghost.sampled_at.get(r.request_id, {})
        outputs = r.output_token_ids
        ctx.witness(bool(outputs) and r.num_preemptions > 0)
        prompt_len = r.num_prompt_tokens
        known = checked.get((r.request_id, prompt_len), ())
        start = len(known) if outputs[:len(known)] == known else 0
        for i in range(start, len(outputs)):
            pos, token = prompt_len + i, outputs[i]
            if token not in sampled.get(pos, ()):
                yield (f"{r.request_id}: output token {i} (position {pos}) is {token}, but "
                       f"the worker sampled {sorted(sampled.get(pos, ())) or 'nothing'} there")
                break
        else:
            checked[(r.request_id, prompt_len)] = outputs


def _is_loaded_one_token_prompt(ctx: Context, r) -> bool:
    return r.num_tokens == 1 and r.request_id in ctx.ghost.just_loaded


@invariant(cites="seed 004 (_preempt_request)", scope="request")
def idle_waiting_holds_no_blocks(ctx: Context):
    """A WAITING or PREEMPTED request with no computed tokens holds no blocks,
    except, until it runs, a one-token prompt whose async load just finished:
    loaded whole, it counts nothing (its one token is recomputed), yet the
    blocks hold the loaded KV.

    Protects the pool: preemption exists to free memory; a preempted request
    that kept its blocks leaks them and starves the running ones."""
    for r in ctx.live():
        if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.num_computed_tokens == 0:
            ctx.witness(r.num_preemptions > 0)
            if any(r.block_ids) and not _is_loaded_one_token_prompt(ctx, r):
                yield f"{r.request_id} is {r.status.name} with 0 computed tokens but holds blocks {_blocks(r)}"


@invariant(cites="seed 004 (_preempt_request)", scope="request")
def preempted_means_preempted(ctx: Context):
    """A PREEMPTED request has been preempted at least once.

    Protects the scheduler's own bookkeeping (new vs resumed requests in the
    scheduler output) and the stats' scope; it is one of the shape facts the Z3
    induction needs (``request_invariants`` in spec/effects.py)."""
    for r in ctx.live():
        if r.status == RequestStatus.PREEMPTED:
            ctx.witness()
            if not is_preempted_counted(True, r.num_preemptions):
                yield f"{r.request_id} is PREEMPTED with num_preemptions={r.num_preemptions}"


@invariant(cites="seed 004 (allocate_slots)", scope="request")
def blocks_cover_computed(ctx: Context):
    """Every computed token (and every token an async load targets) has a slot:
    ``len(block_table) * block_size >= num_computed_tokens`` in every group."""
    for r in ctx.live():
        ctx.witness(r.num_computed_tokens > 0)
        for g, table in enumerate(r.block_ids or ((),)):
            size = ctx.obs.config.groups[g].block_size
            if not is_blocks_cover_computed(len(table), size, r.num_computed_tokens):
                yield (f"{r.request_id}: group {g} has {len(table)} blocks of {size} for "
                       f"{r.num_computed_tokens} computed tokens")


def get_first_missing_read(group, table, real: int) -> list[int]:
    """The first index of a block a step from ``real`` reads that ``table`` does
    not hold (past its end, or ``NULL_BLOCK``), as a list of at most one; for
    full attention, its first ``NULL_BLOCK`` wherever it is."""
    if group.kind != "full_attention":
        return [i for i in get_blocks_read(group, real)
                if i >= len(table) or table[i] == NULL_BLOCK][:1]
    if NULL_BLOCK in table:
        return [table.index(NULL_BLOCK)]
    # every block from 0 is read: the first one missing is the first past the table
    read = get_positions_read(group, real)
    return [len(table)] if read and (read.stop - 1) // group.block_size >= len(table) else []


@invariant(cites="seed 003 (#35223); #45474", scope="request")
def every_group_serves_computed(ctx: Context):
    """In every KV cache group, the blocks a request's next step reads hold a
    block, not ``NULL_BLOCK``: full attention every block under its computed
    prefix, a sliding window the blocks of its last ``w - 1`` positions, a
    last-state group the block of the state after its last computed token
    (``spec/reads.py``, apart from the block arithmetic the reference frees by). The prefix counted is the real one (without the
    placeholders of steps in flight): a step runs from it at the earliest.

    Protects hybrid models (Gemma 3, gpt-oss, Jamba): a windowed group gives
    blocks back as the window moves on, so a recovery or a prefix hit that
    counts a prefix by the full-attention group alone leaves the window behind
    it empty, and the model reads whatever the freed block holds next.
    #35223's review found the per-group accounting of exactly this wrong.
    Witnessed by a request whose windowed group has given a block back."""
    groups = ctx.obs.config.groups
    for r in ctx.live():
        real = get_real_computed(r)
        for g, table in enumerate(r.block_ids):
            ctx.witness(NULL_BLOCK in table)
            missing = get_first_missing_read(groups[g], table, real)
            if missing:
                yield (f"{r.request_id}: group {g} ({groups[g].kind}) reads block "
                       f"{missing[0]} from {real} computed tokens, but its table holds "
                       f"no block there: {list(table)}")


# -- queues and limits --------------------------------------------------------

@invariant(cites="seed 004 (schedule, finish_requests)", scope="request")
def queues_match_status(ctx: Context):
    """Each live request is in exactly one queue, the one its status names:
    RUNNING in ``running``, WAITING / WAITING_FOR_REMOTE_KVS / PREEMPTED in
    ``waiting``; finished requests in neither."""
    running, waiting = ctx.obs.running, ctx.obs.waiting
    ctx.witness(bool(running) and bool(waiting))
    in_running, in_waiting = set(running), set(waiting)
    for name, queue, members in (("running", running, in_running),
                                 ("waiting", waiting, in_waiting)):
        if len(members) != len(queue):
            yield f"{name} queue has duplicates: {queue}"
    for r in ctx.requests():
        where = (r.request_id in in_running, r.request_id in in_waiting)
        want = ((r.status == RequestStatus.RUNNING), r.status.is_waiting)
        if where != want:
            yield f"{r.request_id} is {r.status.name} but in running={where[0]} waiting={where[1]}"
    for rid in running + waiting:
        if rid not in ctx.obs.requests:
            yield f"queue holds unknown request {rid}"


@invariant(cites="seed 004 (schedule asserts)", scope="request")
def within_limits(ctx: Context):
    """At most ``max_num_seqs`` requests run, and no request grows past ``max_model_len``.
    Witnessed when the running queue is full or a request is one token from the limit."""
    cfg = ctx.obs.config
    ctx.witness(len(ctx.obs.running) == cfg.max_num_seqs)
    if len(ctx.obs.running) > cfg.max_num_seqs:
        yield f"{len(ctx.obs.running)} running > max_num_seqs={cfg.max_num_seqs}"
    for r in ctx.live():
        ctx.witness(r.num_tokens >= cfg.max_model_len - 1)
        if r.num_tokens > cfg.max_model_len:
            yield f"{r.request_id}: {r.num_tokens} tokens > max_model_len={cfg.max_model_len}"


# -- block accounting ---------------------------------------------------------

def _holders(ctx: Context) -> list[int]:
    """References per block: block tables, the fenced frees of steps in
    flight, and a real connector's pins on blocks it transfers."""
    count = [0] * ctx.obs.pool.num_blocks
    # tallied first (in C), then added block by block as one table entry at a time was
    tally = Counter(chain.from_iterable(chain.from_iterable(
        r.block_ids for r in ctx.obs.requests.values())))
    tally.update(ctx.obs.pool.fenced)
    tally.update(ctx.obs.pool.pinned)
    fenced_null = sum(b == NULL_BLOCK for b in (*ctx.obs.pool.fenced, *ctx.obs.pool.pinned))
    for b, times in tally.items():
        if b != NULL_BLOCK:  # a block a windowed group gave back
            count[b] += times
    if fenced_null:  # a fence or pin on NULL_BLOCK counts (on the last block, as it did)
        count[NULL_BLOCK] += fenced_null
    return count


#: a free-queue tuple's blocks, as a set (the targets hand back the very
#: tuple while the queue is unchanged: one set per queue state)
get_free_set = DerivedByIdentity(frozenset)


def _holders_of(ctx: Context, blocks) -> dict[int, int]:
    """``_holders`` of ``blocks`` alone (the tables' entries tallied by
    difference from the last requests counted: ``spec/table_tally.py``)."""
    tally = get_table_tally(ctx.obs.requests)
    # NULL_BLOCK: a block a windowed group gave back, which no table entry counts
    count = {b: tally[b] if b != NULL_BLOCK else 0 for b in blocks}
    for b in chain(ctx.obs.pool.fenced, ctx.obs.pool.pinned):
        if b in count:  # a fence or pin counts, on NULL_BLOCK too
            count[b] += 1
    return count


@invariant(cites="seed 004 (block_pool)", scope="block")
def ref_count_is_holders(ctx: Context):
    """A block's reference count equals the number of block tables holding it
    (finished requests that wait for a KV send included), plus the references a
    free fenced behind a step in flight still holds, plus those a real
    connector pins while it transfers a block (``--connector``).

    Protects against double frees and leaks: a block freed while still held is
    handed to another request and overwritten under the first. Witnessed by a
    block two tables share."""
    ref_cnt = ctx.obs.pool.ref_cnt
    if ctx.is_narrowed("block"):
        held = _holders_of(ctx, ctx.blocks())
        pairs = [(b, ref_cnt[b], held[b]) for b in ctx.blocks()]
        ctx.witness(sum(held >= 2 for _b, _ref, held in pairs))
    else:
        holders = ctx.holders()
        pairs = zip(range(len(ref_cnt)), ref_cnt, holders)
        ctx.witness(sum(held >= 2 for held in holders[:len(ref_cnt)]))
    for b, ref, held in pairs:
        # ``ref == held``: the predicate holds (``held`` flags, each counting 1)
        if ref != held and not is_ref_count_of_holders(ref, [True] * held):
            yield f"block {b}: ref_cnt={ref} but {held} holder(s)"


@invariant(cites="seed 004 (block_pool)", scope="block")
def free_queue_is_free_blocks(ctx: Context):
    """The free queue holds exactly the blocks with reference count 0, once each;
    no block is both free and held. Witnessed when some blocks are free and some held."""
    pool = ctx.obs.pool
    free = pool.free_queue
    ctx.witness(0 < len(free) < pool.num_blocks)
    free_set = get_free_set(free)
    if len(free_set) != len(free):
        yield f"free queue has duplicates: {free}"
    if ctx.is_narrowed("block"):
        disagree = [b for b in ctx.blocks() if (b in free_set) != (pool.ref_cnt[b] == 0)]
    else:
        zero = {b for b, ref in enumerate(pool.ref_cnt) if ref == 0}
        # the predicate is judged on every block where free and "ref 0" disagree: it
        # holds wherever they agree (free iff ref 0, both ways)
        disagree = zero.symmetric_difference(b for b in free_set
                                             if b in range(len(pool.ref_cnt)))
    if not all(is_free_iff_unreferenced(b in free_set, pool.ref_cnt[b]) for b in disagree):
        zero = [b for b, ref in enumerate(pool.ref_cnt) if ref == 0]
        yield f"free queue {sorted(free_set)} != blocks with ref 0 {zero}"


@invariant(cites="seed 004 (_free_blocks, finished_sending)")
def no_leak_when_idle(ctx: Context):
    """With no live request and no KV send pending, every block is free (or
    fenced behind a step in flight, until its output is processed, or pinned
    by a real connector's transfer, until its worker reports it done).

    Protects the pool across the lifetime of the server: a leaked block is
    capacity lost until restart. Witnessed when the scheduler holds no request."""
    if not ctx.obs.requests:
        ctx.witness()
        # given back when their step is processed, or their transfer done
        fenced = set(ctx.obs.pool.fenced) | set(ctx.obs.pool.pinned)
        held = [b for b, ref in enumerate(ctx.obs.pool.ref_cnt) if ref and b not in fenced]
        if held:
            yield f"no requests left but blocks {held} are held"


@invariant(cites="seed 004 (_free_request, finished_sending); #46240")
def finished_request_releases_blocks(ctx: Context):
    """A finished request holds blocks only while its KV send is pending (the
    connector asked for a delayed free and ``finished_sending`` has not named it)
    or, until a worker report names its load in ``finished_recving`` (one or
    many reports later), while an async load it was waiting for may still be
    writing them.

    Protects the pool from leaks while the server is busy: a scheduler that
    ignores ``finished_sending`` never frees the request's blocks, which
    ``no_leak_when_idle`` notices only once every request is gone. Witnessed by
    a finished request still known to the scheduler."""
    if not ctx.synced or ctx.oracle is None:
        return
    for r in ctx.obs.requests.values():
        if not r.status.is_finished:
            continue
        ctx.witness()
        pending = r.request_id in ctx.oracle.sends or r.request_id in ctx.ghost.finished_mid_load
        if any(r.block_ids) and not pending:
            yield (f"{r.request_id} is {r.status.name} and holds blocks {_blocks(r)} with no "
                   f"send pending")


@invariant(cites="seed 004 (cache_full_blocks)", scope="block")
def prefix_cache_is_consistent(ctx: Context):
    """Each prefix-cache entry names a distinct block, but for a group whose
    blocks are larger than the hash block: vLLM caches the block holding a
    prompt's last hash boundary under that boundary's hash too (a partial
    entry of the same group, evicted with the block; the data oracle checks
    what each entry names). Witnessed by a non-empty cache."""
    groups, size = ctx.obs.config.groups, ctx.obs.config.hash_block_size
    ctx.witness(len(ctx.obs.pool.cached) >= 2)
    if ctx.is_narrowed("block"):
        # the same verdict per block: a second entry is allowed only where
        # every entry of the block is of one such group
        index = get_cache_index(ctx.obs.pool.cached)
        for block in sorted(index.shared.intersection(ctx.scope.blocks)):
            found = {split_cache_key(key)[1] for key in index.keys_of(block)}
            if not (len(found) == 1 and _is_partial_group(groups, size, *found)):
                yield f"block {block} cached under two hashes"
        return
    seen = {}
    for key, block in ctx.obs.pool.cached:
        g = split_cache_key(key)[1]
        if block in seen and not (seen[block] == g and _is_partial_group(groups, size, g)):
            yield f"block {block} cached under two hashes"
        seen[block] = g


def _is_partial_group(groups, hash_block_size: int, g: int) -> bool:
    """A group whose blocks are larger than the hash block: one block may be
    cached under a partial entry of the same group too."""
    return g < len(groups) and groups[g].block_size > hash_block_size


# -- the data oracle ----------------------------------------------------------

@invariant(cites="review of #34616", kind="data", scope="block")
def no_caching_of_invalid_blocks(ctx: Context):
    """Every block in the prefix cache holds exactly the content its hash names
    (``is_cached_block_valid``: valid content, no load still writing it).

    Protects every later request: a block whose load failed, or whose load has
    not finished, that enters the prefix cache is served as a hit to the next
    request with that prefix: silent corruption (the review of #34616).
    Witnessed while the cache is not empty and some held block's load failed
    or is still in flight."""
    ctx.witness(bool(ctx.obs.pool.cached) and ctx.oracle.has_bad_blocks())
    # narrowed: the blocks whose entries, content, load or failure mark
    # changed, or whose key was learnt (what this conjunct reads of a block)
    yield from ctx.oracle.check_cache(ctx.obs, ctx.scope.get_cached() if ctx.is_narrowed("block")
                                      else None)


# -- efficiency: work a correct scheduler need not lose --------------------------

@invariant(cites="issue 25 (hybrid blocks cached under the plain hash)", kind="data",
           role="efficiency")
def computed_blocks_are_cached(ctx: Context):
    """With prefix caching on, each full block of known tokens a step computes,
    while its running request holds it with valid content, is findable in the
    prefix cache: some cached block holds that content as its group keeps it
    (the block itself, or a copy cached before it). Read from the data oracle's
    content, not from the hashes the scheduler keys its cache by.

    Protects the prefix cache's hit rate, not the KV: a block computed but never
    cached (for one KV cache group keyed under another group's hash, say) is
    recomputed by every later request with that prefix, and every safety claim
    holds. Witnessed by such a block."""
    if not ctx.obs.config.enable_prefix_caching or not ctx.synced:
        return
    ctx.witness(0 if ctx.oracle.has_outstanding_failure() else len(ctx.oracle.completed))
    yield from ctx.oracle.check_completed_cached(ctx.obs)


@invariant(cites="#46240, #43226", kind="data")
def no_load_into_free_blocks(ctx: Context):
    """Every block an async load in flight is writing is held by a request
    (``is_load_target_held``): a scheduler keeps a loading request's blocks until
    the worker reports the load, even when the request ends first. A scheduler
    may free an ended loader's blocks at once (the environment then drops its
    load), but while it holds the request for the report, it holds every block
    the load writes: a windowed group's too.

    Protects the next owner of the block: a block freed under a running load is
    handed out while the load still overwrites it. Witnessed by a load in flight."""
    loading = ctx.oracle.loading_blocks(ctx.ghost.finished_mid_load & set(ctx.obs.requests))
    ctx.witness(len(loading))
    free = get_free_set(ctx.obs.pool.free_queue) if loading else frozenset()
    for block in sorted(loading):
        if not is_load_target_held(True, block in free):
            yield f"block {block} is free while an async load is still writing it"


@invariant(cites="#34616, seed 003", kind="data", scope="request")
def computed_means_valid(ctx: Context):
    """Every token counted in ``num_computed_tokens`` of a request that is not
    WAITING_FOR_REMOTE_KVS has valid KV: computed, a prefix-cache hit, or loaded
    successfully.

    Protects what the model reads: before #34616, an async load counted whole
    blocks, past the last external token, and the model attended to KV nobody
    wrote. Witnessed by a request counting tokens it did not compute itself in
    this run (hits or loads) or after a load failure."""
    for r in ctx.live():
        if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            ctx.witness(r.num_computed_tokens > 0 and (
                r.num_cached_tokens > 0 or r.request_id in ctx.ghost.recovered))
            yield from ctx.oracle.check_request(ctx.obs, r)


@invariant(cites="seed 004 (request_finished, delayed free)", kind="data")
def send_source_intact(ctx: Context):
    """A block held for a KV send keeps its content until ``finished_sending``.

    Protects the receiving instance (P/D disaggregation, offloading): freeing a
    block under an in-flight send ships whatever overwrote it. Witnessed by a
    send in flight. A slot may change to the valid content of its position:
    one that held garbage when the send began (its request's load failed and
    it ended before the failure was reported) is recomputed in place by
    another holder of the block the failure cut back, which repairs what the
    send ships."""
    ctx.witness(len(ctx.oracle.sends))
    yield from ctx.oracle.check_sends()


@invariant(cites="seed 004 (_update_requests_with_invalid_blocks)", kind="data", role="design")
def failed_block_recomputed_once(ctx: Context):
    """In one step no slot is computed by two requests: a failed block shared by
    several requests is recomputed by exactly one of them.

    A design rule of vLLM's recovery, not a safety claim: two writers of the
    same valid content waste compute but corrupt nothing, and a conservative
    recovery in which every affected request recomputes from block 0 is
    correct. Blocks are shared only once full and cached, and a request computes
    only past its own computed prefix, so two writers of one slot means recovery
    sent every sharer to recompute the same block. Witnessed by a step that
    recomputes a failed block another request also holds."""
    ctx.witness(ctx.oracle.shared_recomputes if ctx.after_step else 0)
    yield from ctx.oracle.check_single_writer()
