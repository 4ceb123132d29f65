"""The observation map of vLLM's v1 scheduler (vLLM objects ->
:mod:`kvspec.spec.state`), shared by the ``vllm`` target, which drives a
scheduler it built, and by the observing pytest plugin, which watches the
schedulers other tests build (``kvspec/observe.py``). The mapping decisions
are written down in ``vllm_target.py``'s module doc."""
from __future__ import annotations

from operator import attrgetter

import attrs

from kvspec.harness.frozen import TupleCache, ViewMemo, is_equal, keep_memos_of
from kvspec.harness.target import TargetStateError
from kvspec.spec.groups import NULL_BLOCK, get_group_cache_key, is_windowed
from kvspec.spec.state import (STATS_UNSET, Config, Observation, PoolView, RequestStatus,
                               RequestView, StepView)

#: vLLM's block pool reserves block 0 (the null block): vLLM block b is kvspec's b - 1
NULL_BLOCKS = 1

_STATUS_ALIASES = {
    "FINISHED_IGNORED": RequestStatus.FINISHED_LENGTH_CAPPED,
    "FINISHED_REPETITION": RequestStatus.FINISHED_STOPPED,
    "WAITING_FOR_FSM": RequestStatus.WAITING,
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": RequestStatus.WAITING,
    "WAITING_FOR_STREAMING_REQ": RequestStatus.WAITING,
}

_VIEW_FIELDS = set(attrs.fields_dict(RequestView))


class VllmObserver:
    """Observes ``self.scheduler`` (set by whoever built or found it)."""

    def __init__(self, m, config: Config) -> None:
        self.m, self.config = m, config
        self._stats: dict[str, object] = {}      # request id -> its PrefillStats object
        self._requests: dict[str, object] = {}   # every request added, to see how it ended
        #: each live request's last view and what it was built of (``_view``)
        self._seen: dict[str, ViewMemo] = {}
        #: the pool's counts and free queue as last observed
        self._pool_tuples = TupleCache()
        #: vLLM's prefix-cache keys as kvspec's (``_cached_entries``)
        self._cache_keys: dict = {}
        #: the prefix-cache entries last observed (``_cached_entries``)
        self._last_cached: tuple = ()
        #: the map they were read of, its keys and values then (None: read it again)
        self._cached_from: tuple | None = None
        self._admitted: set[str] = set()         # stats recorded (see the module doc)

    def note_request(self, request) -> None:
        """A request given to the scheduler: its stats object is kept (vLLM hands
        it out with the first output), and the request, to see how it ended."""
        self._stats[request.request_id] = getattr(request, "prefill_stats", None)
        self._requests[request.request_id] = request

    def _as_tables(self, block_ids):
        """A ``new_block_ids`` entry (vLLM ids per group) as kvspec's (None: no
        new block). Not through ``_to_spec_ids``: what the output sends is judged
        by worker_tables_match_scheduler, not asserted here."""
        if block_ids is None:
            return None
        return tuple(tuple(map(_spec_id, group)) for group in block_ids)

    def get_spec_tables(self, block_ids) -> tuple[tuple[int, ...], ...]:
        """Block ids a connector is handed or names (one group's flat list, or
        one list per group) as kvspec's tables, through ``_to_spec_ids``."""
        return tuple(self._to_spec_ids(list(ids), g) for g, ids in enumerate(as_groups(block_ids)))

    def _to_spec_ids(self, vllm_ids, group: int = 0) -> tuple[int, ...]:
        """One group's vLLM block ids as kvspec's: the null block is
        ``NULL_BLOCK`` in a group that gives blocks back, and never in a
        full-attention table."""
        if is_windowed(self.config.groups[group]):
            return tuple([_spec_id(b) for b in vllm_ids])
        if vllm_ids and min(vllm_ids) < NULL_BLOCKS:
            raise TargetStateError(f"a full-attention block table holds the null block "
                                   f"{min(vllm_ids)}")
        return tuple([b - NULL_BLOCKS for b in vllm_ids])

    def _to_spec_blocks(self, blocks, group: int) -> tuple[int, ...]:
        """One group's vLLM blocks (or their ids) as kvspec's block ids."""
        if blocks and not isinstance(blocks[0], int):
            blocks = list(map(_BLOCK_ID, blocks))
        return self._to_spec_ids(blocks, group)

    def get_step_view(self, out, preemptions: dict[str, int]) -> StepView:
        """A ``SchedulerOutput`` as kvspec's step; ``preemptions``: each
        request's preemption count before the call."""
        before: dict[str, int] = {}
        new_ids, told = [], {}
        for data in out.scheduled_new_reqs:
            before[data.req_id] = data.num_computed_tokens
            new_ids.append(data.req_id)
            told[data.req_id] = self._as_tables(data.block_ids)
        cached = out.scheduled_cached_reqs
        check_cached_lists(cached)
        resumed = _resumed_ids(cached)
        sent = getattr(cached, "new_block_ids", None)
        for i, rid in enumerate(cached.req_ids):
            before[rid] = cached.num_computed_tokens[i]
            if sent is not None:
                told[rid] = self._as_tables(sent[i])
        resumed_ids = [rid for rid in cached.req_ids if rid in resumed]
        # who was preempted during this call (the output's preempted_req_ids, where
        # a release has it, also names those a forced reset_prefix_cache preempted
        # since the last call)
        preempted = {rid for rid, r in self.scheduler.requests.items()
                     if getattr(r, "num_preemptions", 0) > preemptions.get(rid, 0)}
        return StepView(
            num_scheduled_tokens=dict(out.num_scheduled_tokens),
            num_computed_before=before,
            scheduled_spec_decode_tokens={k: tuple(v) for k, v in
                                          out.scheduled_spec_decode_tokens.items()},
            new_req_ids=tuple(new_ids), resumed_req_ids=tuple(resumed_ids),
            preempted_req_ids=frozenset(preempted),
            new_block_ids=told if sent is not None else {})

    def _status(self, r) -> RequestStatus:
        name = r.status.name
        if name in RequestStatus.__members__:
            return RequestStatus[name]
        if name in _STATUS_ALIASES:
            return _STATUS_ALIASES[name]
        raise AssertionError(f"unknown vLLM request status {name}")

    def _stats_of(self, r, status: RequestStatus) -> tuple[int, int]:
        rid = r.request_id
        if status == RequestStatus.RUNNING:
            self._admitted.add(rid)  # final from here on (see the module doc)
        if hasattr(r, "prefill_stats"):
            stats = self._stats.get(rid) or r.prefill_stats
            if stats is None or rid not in self._admitted or stats.num_prompt_tokens <= 0:
                return STATS_UNSET, 0
            return stats.num_cached_tokens, stats.num_external_cached_tokens
        cached = getattr(r, "num_cached_tokens", STATS_UNSET)
        if cached < 0:  # not recorded yet: the lookup's external count is provisional
            return STATS_UNSET, 0
        return cached, getattr(r, "num_external_computed_tokens", 0)

    def observe_request(self, request_id: str) -> RequestView:
        """``request_id``'s view: the very view of last time while everything
        it is made of reads as it did then (``_get_reads``), else made again."""
        seen = self._seen.get(request_id)
        if seen is None:
            seen = self._seen[request_id] = ViewMemo()
        r = self.scheduler.requests[request_id]
        reads = self._get_reads(r)
        if reads == seen.reads:
            return seen.view
        # (making the view may admit the request, ``_stats_of``: the next call
        # then reads a change and makes it once more)
        seen.reads = copy_lists(reads)
        return self._view(r, reads[:len(self.config.groups)], seen)

    def _get_reads(self, r) -> tuple:
        """Everything ``r``'s view is made of, as it reads now, untranslated,
        flat: first the block tables as vLLM's own lists of its blocks (a
        pool's block is one object per id), then lists as they are (compared
        with copies of them as last read: vLLM changes them in place), other
        objects by identity beside the fields the view reads of them; what
        changes most often first, so that a changed request is told at once,
        the prompt (2,000 tokens in production) last. Nothing is trusted to
        be unchanged: no version counter, no length standing for a list."""
        rid = r.request_id
        kept = self._stats.get(rid)
        stats = kept or getattr(r, "prefill_stats", None)
        params = getattr(r, "sampling_params", None)
        out = getattr(r, "_output_token_ids", None)  # the list behind the ConstantList
        return (*self._get_block_lists(rid), r.num_computed_tokens,
                tuple(r.output_token_ids) if out is None else out,
                getattr(r, "num_output_placeholders", 0), r.status,
                getattr(r, "num_preemptions", 0), rid in self._admitted, kept,
                *(_NO_STATS if stats is None else _read_stats(stats)),
                getattr(r, "num_cached_tokens", None),
                getattr(r, "num_external_computed_tokens", None),
                params, getattr(params, "eos_token_id", None),
                getattr(params, "stop_token_ids", None), getattr(params, "min_tokens", 0),
                getattr(r, "eos_token_id", None), getattr(r, "pooling_params", None),
                getattr(self.scheduler, "is_mm_encoder_only", False), *_read_request(r))

    def _get_block_lists(self, request_id: str) -> tuple:
        """The request's blocks per group as vLLM holds them (its coordinator's
        own lists, no copy; ``_to_spec_blocks`` translates them), or their ids
        where a release has no coordinator."""
        manager = self.scheduler.kv_cache_manager
        get_blocks = getattr(getattr(manager, "coordinator", None), "get_blocks", None)
        if get_blocks is None:
            return tuple(manager.get_block_ids(request_id))
        return get_blocks(request_id)

    def final_view(self, request_id: str) -> RequestView | None:
        r = self._requests.get(request_id)
        if r is None or request_id in self.scheduler.requests:
            return None
        return self._view(r, tuple([] for _ in self.config.groups), ViewMemo())

    def _view(self, r, tables, seen: ViewMemo) -> RequestView:
        """``r``'s view, holding ``tables`` (its vLLM blocks or block ids per group): the
        very view ``seen`` last time while every field is equal (each read
        afresh; a tuple is the same object while its list is equal)."""
        status = self._status(r)
        cached, external = self._stats_of(r, status)
        extra = self._stop_rules(r) if "eos_token_id" in _VIEW_FIELDS else {}
        tuples = seen.tuples
        return seen.get(dict(
            request_id=r.request_id, status=status,
            prompt_token_ids=tuples.get("prompt", r.prompt_token_ids),
            # a ConstantList, equal to no list: a copy (of a few tokens) every time
            output_token_ids=tuple(r.output_token_ids), max_tokens=r.max_tokens,
            num_computed_tokens=r.num_computed_tokens, num_cached_tokens=cached,
            num_external_computed_tokens=external,
            num_preemptions=getattr(r, "num_preemptions", 0),
            block_ids=tuple([tuples.get(g, blocks, self._to_spec_blocks, g)
                             for g, blocks in enumerate(tables)]),
            block_hashes=tuples.get("hashes", r.block_hashes),
            spec_token_ids=tuples.get("spec", r.spec_token_ids),
            num_output_placeholders=getattr(r, "num_output_placeholders", 0),
            priority=r.priority, **extra), _make_view)

    def _stop_rules(self, r) -> dict:
        """What ends ``r`` besides its length (newer kvspec states carry it)."""
        params = getattr(r, "sampling_params", None)
        extra = {"eos_token_id": getattr(params, "eos_token_id", getattr(r, "eos_token_id", None))}
        if "samples_tokens" in _VIEW_FIELDS:
            stop_ids = getattr(params, "stop_token_ids", None)
            min_tokens = getattr(params, "min_tokens", 0)
            extra.update(
                stop_token_ids=tuple(stop_ids) if isinstance(stop_ids, (list, tuple)) else (),
                min_tokens=min_tokens if isinstance(min_tokens, int) else 0,
                samples_tokens=not (getattr(r, "pooling_params", None)
                                    or getattr(self.scheduler, "is_mm_encoder_only", False)),
                detects_repetition=getattr(getattr(params, "repetition_detection", None),
                                           "max_pattern_size", 0) > 0)
        return extra

    def _pool_view(self) -> PoolView:
        """Counts and free queue read whole, each the same tuple as last time while equal."""
        pool = self.scheduler.kv_cache_manager.block_pool
        tuples = self._pool_tuples
        # the free blocks as vLLM's objects, translated only when they changed
        free = tuples.get("free", pool.free_block_queue.get_all_free_blocks(), _to_spec_block_ids)
        # a hybrid request's deferred free lists the null block of its windowed groups
        fenced = tuple(b.block_id - NULL_BLOCKS for _, held in
                       getattr(self.scheduler, "deferred_frees", ()) for b in held
                       if b.block_id >= NULL_BLOCKS)
        world = getattr(self, "world", None)
        pinned = () if world is None else tuple(b - NULL_BLOCKS for b in world.get_pins())
        return PoolView(
            ref_cnt=tuples.get_equal("ref_cnt", tuple(map(_REF_CNT, pool.blocks[NULL_BLOCKS:]))),
            free_queue=free,
            cached=self._cached_entries(pool.cached_block_hash_to_block), fenced=fenced,
            pinned=pinned)

    def _cached_entries(self, table) -> tuple:
        """Every prefix-cache entry as kvspec's (key, block id), in the map's
        order; the very tuple of last time while equal. Not translated again
        while the map holds equal keys and equal blocks in the same order (a
        block compares its id first; in one pool ids are distinct) and held
        no dict of several copies (one may change in place)."""
        entries = getattr(table, "_cache", table)  # a BlockHashToBlockMap, or a plain dict
        keys, values = list(entries), list(entries.values())
        last = self._cached_from
        if last is not None and last[0] is entries and last[1] == keys and last[2] == values:
            return self._last_cached
        spec_keys = self._get_spec_keys(keys)
        try:  # one block per key, read in C loops (10,000 entries in production)
            cached = tuple(zip(spec_keys, [b - NULL_BLOCKS for b in map(_BLOCK_ID, values)]))
            self._cached_from = (entries, keys, values)
        except AttributeError:  # a key holds a dict of several copies
            cached = tuple((spec_key, block.block_id - NULL_BLOCKS)
                           for spec_key, value in zip(spec_keys, values)
                           for block in (value.values() if isinstance(value, dict) else [value]))
            self._cached_from = None
        if not is_equal(cached, self._last_cached):  # else the very same tuple as last
            self._last_cached = cached  # time: those who read it compare it by identity
        return self._last_cached

    def _get_spec_keys(self, keys: list) -> list:
        """vLLM prefix-cache keys as kvspec's (a key's translation never
        changes: each worked out once, and again after the memo, grown to
        twice the keys cached now, is dropped: evicted keys leave it)."""
        known = self._cache_keys
        if len(known) > 2 * len(keys) + 1024:
            known.clear()
        spec_keys = list(map(known.get, keys))
        i = 0
        for _ in range(spec_keys.count(None)):  # the new ones, found in C loops
            i = spec_keys.index(None, i)
            key = keys[i]
            block_hash = self.m.get_block_hash(key) if self.m.get_block_hash else key
            group = self.m.get_group_id(key) if self.m.get_group_id else 0
            spec_keys[i] = known[key] = get_group_cache_key(block_hash, group)
        return spec_keys

    def observe(self) -> Observation:
        s = self.scheduler
        requests = {rid: self.observe_request(rid) for rid in s.requests}
        self._seen = keep_memos_of(self._seen, requests)
        for rid in [rid for rid in self._stats if rid not in s.requests]:
            del self._stats[rid]
            self._admitted.discard(rid)
        waiting = [r.request_id for r in s.waiting]
        waiting += [r.request_id for r in getattr(s, "kv_holding_waiting", ())]
        waiting += [r.request_id for r in getattr(s, "skipped_waiting", ())]
        return Observation(
            config=self.config, requests=requests, waiting=tuple(waiting),
            running=tuple(r.request_id for r in s.running), pool=self._pool_view(),
            sending=tuple(rid for rid, r in requests.items() if r.status.is_finished))



_BLOCK_ID, _REF_CNT = attrgetter("block_id"), attrgetter("ref_cnt")

#: what every release's requests carry of what a view is made of (``_get_reads``)
_read_request = attrgetter("spec_token_ids", "max_tokens", "priority", "block_hashes",
                           "prompt_token_ids")
#: what a view reads of a request's prefill stats (each read as ``_stats_of`` does)
_read_stats = attrgetter("num_cached_tokens", "num_external_cached_tokens", "num_prompt_tokens")
_NO_STATS = (None,) * 3


def copy_lists(reads: tuple) -> tuple:
    """``reads`` with each list copied (a list read later compares with it
    element by element)."""
    return tuple([list(x) if type(x) is list else x for x in reads])


def _make_view(fields: dict) -> RequestView:
    return RequestView(**fields)


def as_groups(block_ids) -> list:
    """vLLM hands a connector a flat list of block ids for a single-group
    model and one list per group otherwise: always one list per group."""
    return block_ids if block_ids and isinstance(block_ids[0], (list, tuple)) else [block_ids]


def _to_spec_block_ids(blocks) -> tuple[int, ...]:
    """vLLM blocks (none the null block) as kvspec's ids, in C loops."""
    return tuple(map(NULL_BLOCKS.__rsub__, map(_BLOCK_ID, blocks)))  # block_id - NULL_BLOCKS


def _spec_id(vllm_id: int) -> int:
    """A vLLM block id as kvspec's (vLLM's null block is ``NULL_BLOCK``)."""
    return NULL_BLOCK if vllm_id < NULL_BLOCKS else vllm_id - NULL_BLOCKS


def check_cached_lists(cached) -> None:
    """The output's lists about scheduled cached requests are one entry per
    request id (vLLM's model runner reads them by position): a shorter or
    longer one is the scheduler's broken output, not kvspec's crash."""
    count = len(cached.req_ids)
    for name in ("num_computed_tokens", "new_block_ids"):
        got = getattr(cached, name, None)
        if got is not None and len(got) != count:
            raise TargetStateError(f"the scheduler output names {count} cached request(s) "
                                   f"but gives {len(got)} {name}")


def _resumed_ids(cached) -> set[str]:
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is not None:
        return set(resumed)
    flags = getattr(cached, "resumed_from_preemption", None) or ()
    return {rid for rid, flag in zip(cached.req_ids, flags) if flag}
