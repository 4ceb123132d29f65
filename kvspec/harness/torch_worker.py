"""The torch worker (issue 13, parts 5 and 6): the runner's model of the worker
with real KV tensors, beside the symbolic data oracle (``spec/oracle.py``).

Each step the scheduler produced, it

1. **loads** what the environment's connector loads: a sync load of every
   scheduled request that has one, and the async loads the step reports
   finished, through ``KVLoader`` from a ``KVStore``. The blocks the oracle
   fails get garbage and come back in ``invalid_block_ids``: the oracle draws
   the faults from the step's action (``fail``, ``fail_all``, ``fail_offset``,
   ``fail_blocks``, ``fail_group``), the loader makes them happen, and the two
   reports must agree;
2. **computes**: ``TinyTransformer.forward_paged`` of every scheduled request
   through the block tables the scheduler produced, and samples greedily from
   the logits (``greedy_token``, ``count_accepted`` for drafts);
3. **checks**: per-block checksums on the device against the no-cache
   reference's K/V, for every block the step read or wrote and every block in
   the prefix cache, except blocks the oracle knows to be bad (a failed load,
   a load not reported yet, a block written by a request that read one of
   those). A mismatch is a ``kv_tensors_match_oracle`` violation naming the
   step, the block and the request;
4. **offloads**: the blocks an offloading request computed, once checked, go
   to the store, from which a later reload (after a preemption or eviction)
   copies them back.

And when a request ends (``check_ended``), its output tokens must be the
no-cache model's greedy tokens, and the logits it sampled from must agree with
the reference's within ``LOGITS_TOL``, unless it ended with an error (policy
"fail").

What the external store holds beyond what this run offloaded (the
environment's ``ext`` prefix, or an offloaded block saved at another length)
was computed by another engine: the worker computes it on demand with
``forward_paged`` of the same model in a separate cache and saves it, so every
load copies real tensors a model wrote.

Determinism: an async load starts in the step the environment reports it and
``loader.wait()`` runs before that step's compute, so a replay reads the same
bytes in the same order; faults write seeded garbage; the model's weights come
from a fixed seed. The tensors live on CUDA when present (``get_device``),
else on the CPU with one torch thread (the tensors are tiny).
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Callable, Sequence

import torch

from kvspec.gpu.checksum import ExpectedBlock, check_blocks, compute_expected_checksums
from kvspec.gpu.loader import KVLoader, LoadFault, compute_garbage
from kvspec.gpu.model import TinyConfig, TinyTransformer
from kvspec.gpu.store import KVStore
from kvspec.harness.kv_modes import KV_CLAIM, KVWorkerError
from kvspec.spec.groups import NULL_BLOCK, get_read_positions, split_cache_key
from kvspec.spec.oracle import extend_prefix_keys
from kvspec.spec.registry import Violation
from kvspec.spec.state import Config, Observation, RequestStatus, RequestView, StepView

KV_CLAIM_DOC = ("What the model reads is right, in real tensors: every block a step reads "
                "or writes, and every block in the prefix cache, holds the K/V the no-cache "
                "forward computes for the tokens it stands for, unless a reported load "
                "failure left it bad; and each request's greedy tokens and logits are the "
                "no-cache model's (issue 13).")
#: logits of a correct cache agree with the reference within this (the bound
#: tests/test_gpu.py justifies: 1.6e-6 measured drift, a wrong block moves
#: logits by more than 1e3 times it)
LOGITS_TOL = 1e-4
#: what the model embeds for a draft slot the drafter left empty (-1): vLLM
#: pads drafts with -1 and never accepts them; any fixed token does here
PAD_TOKEN = 0
EOS_TOKEN_ID = 0
#: the owner an ExpectedBlock of a prefix-cache entry names
CACHE_OWNER = "<prefix cache>"
#: seed of the garbage failed loads write (the loader mixes in the block id)
GARBAGE_SEED = 13


#: where the worker's tensors live; None: CUDA when present, else the CPU
#: (tests pin it to run the same workloads on each device)
DEVICE: str | None = None


def get_device() -> str:
    return DEVICE or ("cuda" if torch.cuda.is_available() else "cpu")


@functools.lru_cache(maxsize=8)
def get_model(sliding_window: int, device: str = "cpu") -> TinyTransformer:
    """The tiny model for a layout (weights from TinyConfig's fixed seed,
    drawn on the CPU: every device runs the same model)."""
    return TinyTransformer(TinyConfig(sliding_window=sliding_window), device=device)


def get_sliding_window(config: Config) -> int:
    """The model's window for the config's groups: 0 for one full-attention
    group, the window for full attention + one sliding window (the tiny
    model's layouts); ValueError for any other layout."""
    kinds = [g.kind for g in config.groups]
    if config.has_mixed_block_sizes:
        raise ValueError("--kv torch runs groups of one block size; groups of block sizes "
                         f"{[g.block_size for g in config.groups]} need a cache per group")
    if kinds == ["full_attention"]:
        return 0
    if kinds == ["full_attention", "sliding_window"]:
        return config.groups[1].sliding_window
    raise ValueError(f"--kv torch runs the layouts full and sliding; groups {kinds} need a "
                     "recurrent (last-state) layer the tiny model does not have")


class ReferenceBook:
    """The no-cache reference's K/V, memoized: a causal model's K/V for a
    prefix are the first rows of those of any longer sequence, so one run
    serves every prefix of it."""

    def __init__(self, model: TinyTransformer, size: int = 64) -> None:
        self.model = model
        self.size = size
        self.runs: list[tuple[tuple[int, ...], list]] = []

    def get_kv(self, tokens: tuple[int, ...]) -> list:
        for seq, kv in self.runs:
            if seq[:len(tokens)] == tokens:
                return kv
        kv = self.model.compute_reference_kv(list(tokens))
        self.runs = [(tokens, kv)] + self.runs[:self.size - 1]
        return kv


def _model_tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    return tuple(PAD_TOKEN if t < 0 else t for t in tokens)


class TorchWorker:
    """See the module docstring. ``content``: the run's data oracle; ``plans``:
    the environment's plan per request (``EnvConnector.plans``)."""

    def __init__(self, config: Config, content, plans: dict) -> None:
        torch.set_num_threads(1)
        self.config = config
        self.content = content
        self.plans = plans
        self.block_size = config.block_size
        self.device = get_device()
        self.model = get_model(get_sliding_window(config), self.device)
        self.cache = self.model.allocate_cache(config.num_blocks, self.block_size)
        self.store = KVStore.for_cache(self.cache, capacity=4 * config.num_blocks + 64)
        self.loader = KVLoader(self.store, self.cache, seed=GARBAGE_SEED)
        per_group = -(-config.max_model_len // self.block_size) + 1
        #: the other engine that computed what the store holds beyond this run's saves
        self.remote = self.model.allocate_cache(per_group * len(config.groups), self.block_size)
        self.remote_tables = [list(range(g * per_group, (g + 1) * per_group))
                              for g in range(len(config.groups))]
        self.references = ReferenceBook(self.model)
        #: request -> (first position, logits of its tokens) of the last step it ran in
        self.logits: dict[str, tuple[int, torch.Tensor]] = {}
        #: request -> position -> the logits row its token there was sampled from
        self.sampled_rows: dict[str, dict[int, torch.Tensor]] = {}
        #: request -> positions where the environment forced EOS
        self.forced_eos: dict[str, set[int]] = {}
        #: block hash -> the tokens it names (from the requests' hash chains)
        self.hash_tokens: dict = {}
        self.ended: set[str] = set()
        self.violations: list[Violation] = []
        self.stats: Counter = Counter()

    # -- one step ------------------------------------------------------------

    def execute(self, step: StepView, mid: Observation, pending: dict[str, tuple[int, ...]],
                run_oracle: Callable):
        """Run the step: the oracle first (it draws the faults), then the
        loads, the compute and the checks in tensors. Returns the oracle's report."""
        bad_before = set(self.content.failed_blocks) | self.content.get_unreported_blocks()
        loads = dict(self.content.loads)
        report = run_oracle()
        self._learn_hashes(mid)
        loaded = self._run_loads(step, mid, report, loads)
        sequences = self._sequences(step, mid, pending)
        self._compute(step, mid, sequences)
        known = (bad_before - loaded) | report.invalid_block_ids
        bad, tainted = self._find_bad(step, mid, sequences, known)
        checked = self._check(step, mid, sequences, bad, tainted, report.step_id)
        self._offload(step, mid, sequences, tainted, checked)
        self.stats["steps"] += 1
        return report

    def _learn_hashes(self, obs: Observation) -> None:
        size = self.block_size
        for r in obs.requests.values():
            tokens = r.all_token_ids
            for i, h in enumerate(r.block_hashes):
                if (i + 1) * size <= len(tokens):
                    self.hash_tokens.setdefault(h, tokens[:(i + 1) * size])

    # -- loads ---------------------------------------------------------------

    def _run_loads(self, step: StepView, mid: Observation, report, loads: dict) -> set[int]:
        """The loads the oracle ran this step, in tensors, with its faults.
        Returns the blocks they filled (failed ones included)."""
        jobs = [loads[rid] for rid in sorted(report.finished_recving) if rid in loads]
        jobs += [job for rid, job in loads.items()
                 if rid in step.num_scheduled_tokens and not job.is_async]
        failed: set[int] = set()
        filled: set[int] = set()
        async_started: set[str] = set()
        for job in jobs:
            request = mid.requests.get(job.request_id)
            if request is None:
                raise KVWorkerError(f"the oracle ran a load of {job.request_id}, which the "
                                    "scheduler does not hold")
            failed |= self._load(job, request.all_token_ids, report.invalid_block_ids,
                                 async_started, filled)
        # the step that reports the async loads waits for them: a replay
        # reads the same bytes whatever the thread's timing
        self.loader.wait()
        done = self.loader.report()
        failed |= done.invalid_block_ids
        if failed != set(report.invalid_block_ids) or done.finished_recving != async_started:
            raise KVWorkerError(
                f"the loader failed blocks {sorted(failed)} and finished "
                f"{sorted(done.finished_recving)}; the oracle failed "
                f"{sorted(report.invalid_block_ids)} and finished {sorted(async_started)}")
        return filled

    def _load(self, job, tokens: tuple[int, ...], invalid: set[int],
              async_started: set[str], filled: set[int]) -> set[int]:
        """One request's load: whole blocks through the loader (async or sync),
        a block the load covers only in part slot by slot (a real connector
        writes only the positions it loads). Returns the partial blocks it failed."""
        end = job.start + job.num_tokens
        if end > len(tokens):
            raise KVWorkerError(f"a load of {job.request_id} ends at {end}, past its "
                                f"{len(tokens)} tokens")
        keys, block_ids, failed = [], [], set()
        for g in range(len(self.config.groups)):
            table = job.block_ids[g] if g < len(job.block_ids) else ()
            for index in range(job.start // self.block_size, -(-end // self.block_size)):
                if index >= len(table) or table[index] == NULL_BLOCK:
                    continue
                lo = max(job.start, index * self.block_size) - index * self.block_size
                hi = min(end, (index + 1) * self.block_size) - index * self.block_size
                key = self._stored_key(g, tokens[:index * self.block_size + hi])
                filled.add(table[index])
                if (lo, hi) == (0, self.block_size):
                    keys.append(key)
                    block_ids.append(table[index])
                else:
                    failed |= self._load_slots(key, table[index], lo, hi, invalid)
        self.stats["blocks_loaded"] += len(block_ids)
        if block_ids:
            fault = LoadFault(frozenset(invalid) & set(block_ids))
            if job.is_async:
                self.loader.start_load(job.request_id, keys, block_ids, fault)
                async_started.add(job.request_id)
            else:
                self.loader.load(job.request_id, keys, block_ids, fault)
        return failed

    def _load_slots(self, key, block_id: int, lo: int, hi: int, invalid: set[int]) -> set[int]:
        """Copy slots ``[lo, hi)`` of a stored block (garbage if it fails)."""
        source = self.store.get_block(key)
        if block_id in invalid:
            source = compute_garbage(self.cache.block_shape, self.cache.dtype, GARBAGE_SEED,
                                     block_id)
        self.cache.kv[block_id, :, :, lo:hi].copy_(source[:, :, lo:hi])
        self.stats["partial_blocks_loaded"] += 1
        return {block_id} & invalid

    def _stored_key(self, group: int, tokens: tuple[int, ...]):
        """The store's key of the block of ``group`` ending at ``len(tokens)``,
        computed by the other engine first if this run never saved it."""
        key = (group, tokens)
        if not self.store.is_stored(key):
            self._compute_remotely(tokens)
            self.stats["blocks_from_remote"] += 1
        else:
            self.stats["blocks_from_store"] += 1
        return key

    def _compute_remotely(self, tokens: tuple[int, ...]) -> None:
        """Another engine runs the prefix and saves its blocks under the keys
        a load of any prefix of it ending at a block boundary (or at its end) asks for."""
        self.model.forward_paged(self.remote, list(_model_tokens(tokens)), self.remote_tables, 0)
        size = self.block_size
        for g, table in enumerate(self.remote_tables):
            count = -(-len(tokens) // size)
            keys = [(g, tokens[:min((i + 1) * size, len(tokens))]) for i in range(count)]
            self.store.save_blocks(keys, self.remote, table[:count])

    # -- compute -------------------------------------------------------------

    def _sequences(self, step: StepView, mid: Observation, pending) -> dict:
        """Per runnable scheduled request: (start, tokens through its step, drafts
        included as scheduled: -1 for an empty slot)."""
        found = {}
        for rid, n in step.num_scheduled_tokens.items():
            request = mid.requests.get(rid)
            if request is None or n <= 0:
                continue
            known = request.all_token_ids + tuple(pending.get(rid, ()))
            seq = known + tuple(step.scheduled_spec_decode_tokens.get(rid, ()))
            start = step.num_computed_before[rid]
            if start + n > len(seq):
                self.stats["steps_past_tokens"] += 1  # the state claims report it
                continue
            found[rid] = (start, seq[:start + n])
        return found

    def _compute(self, step: StepView, mid: Observation, sequences: dict) -> None:
        """Every scheduled request's forward. vLLM writes every token's K/V of
        a layer before that layer's attention reads any: a block one request
        recomputes is valid for another reading it in the same step. One
        request at a time, that holds if the writers of blocks others hold run
        first."""
        for rid in step.num_scheduled_tokens:
            self.logits.pop(rid, None)
        held_by = Counter(b for rid in sequences for t in mid.requests[rid].block_ids for b in t)
        order = sorted(sequences, key=lambda rid: not any(
            held_by[b] > 1 for b in self._written_blocks(mid.requests[rid], *sequences[rid])))
        for rid in order:
            start, seq = sequences[rid]
            tables = [list(t) for t in mid.requests[rid].block_ids]
            try:
                logits = self.model.forward_paged(self.cache, list(_model_tokens(seq[start:])),
                                                  tables, start)
            except ValueError as exc:  # a table the step cannot run through
                self.violations.append(Violation(
                    KV_CLAIM, f"{rid}: the step cannot run through its block tables: {exc}",
                    KV_CLAIM_DOC))
                continue
            self.logits[rid] = (start, logits)

    def _written_blocks(self, request: RequestView, start: int, seq) -> set[int]:
        size = self.block_size
        return {t[p // size] for t in request.block_ids for p in range(start, len(seq))
                if p // size < len(t) and t[p // size] != NULL_BLOCK}

    # -- checks --------------------------------------------------------------

    def _read_blocks(self, request: RequestView, start: int) -> set[int]:
        size, found = self.block_size, set()
        for g, group in enumerate(self.config.groups):
            table = request.block_ids[g] if g < len(request.block_ids) else ()
            found |= {table[p // size] for p in get_read_positions(group, start)
                      if p // size < len(table) and table[p // size] != NULL_BLOCK}
        return found

    def _find_bad(self, step: StepView, mid: Observation, sequences: dict, known: set[int]):
        """Blocks the oracle knows hold bad KV after the step, and the requests
        that read one (their writes are bad too), to a fixed point. A known bad
        block that a clean request rewrote from its first slot this step is good
        again (same-step writes land before reads)."""
        size, tainted = self.block_size, set()
        while True:
            rewritten = set()
            for rid, (start, seq) in sequences.items():
                if rid in tainted:
                    continue
                for t in mid.requests[rid].block_ids:
                    rewritten |= {t[p // size] for p in range(start, len(seq))
                                  if p % size == 0 and p // size < len(t)}
            bad = (known - rewritten) | {b for rid in tainted
                                         for b in self._written_blocks(mid.requests[rid],
                                                                       *sequences[rid])}
            more = {rid for rid, (start, _) in sequences.items()
                    if rid not in tainted and self._read_blocks(mid.requests[rid], start) & bad}
            if not more:
                return bad, tainted
            tainted |= more

    def _check(self, step: StepView, mid: Observation, sequences: dict, bad: set[int],
               tainted: set[str], step_id: int) -> set[int]:
        """Checksums of what the step read and wrote and of the prefix cache,
        in one device pass. Returns the blocks that checked clean."""
        expected = []
        for rid, (start, seq) in sequences.items():
            if rid not in tainted:
                expected += self._expect_request(mid.requests[rid], start, seq, bad)
        expected += self._expect_cached(mid, bad)
        mismatches = check_blocks(self.cache, expected, step_id)
        for m in mismatches:
            self.violations.append(Violation(KV_CLAIM, self._describe(m, mid, sequences),
                                             KV_CLAIM_DOC))
        self.stats["blocks_checked"] += len(expected)
        return {e.block_id for e in expected} - {m.block_id for m in mismatches}

    def _describe(self, m, mid: Observation, sequences: dict) -> str:
        """A mismatch, and whether the symbolic oracle agrees the block is bad."""
        where = (f"step {m.step}: block {m.block_id} (index {m.block_index}, group {m.group})"
                 f" holds the wrong KV in layers {list(m.layers)} ({m.worst:.3g}x the tolerance)")
        if m.request_id == CACHE_OWNER:
            oracle = self._oracle_holds_cached(mid, m.block_id, m.group)
            return (f"{where}, though it is in the prefix cache; the data oracle "
                    f"{'agrees' if oracle is False else 'says it is valid'}")
        start, seq = sequences[m.request_id]
        keys: list[int] = []
        extend_prefix_keys(keys, sequences[m.request_id][1], 0)
        table = mid.requests[m.request_id].block_ids[m.group]
        first = m.block_index * self.block_size
        valid = all(self.content._is_valid(table, m.group, keys, p)
                    for p in range(first, min(first + self.block_size, len(seq))))
        return (f"{where}, read or written by {m.request_id} at step start {start} with no "
                f"reported load failure to excuse it; the data oracle "
                f"{'says it is valid' if valid else 'agrees it is not valid'}")

    def _oracle_holds_cached(self, mid: Observation, block: int, group: int):
        for key, b in mid.pool.cached:
            block_hash, g = split_cache_key(key)
            valid = self.content.holds_named(block, g, block_hash)
            if (b, g) == (block, group) and valid is not None:
                return valid
        return None

    def _expect_request(self, request: RequestView, start: int, seq, bad: set[int]):
        """Each block of the request's tables holding a position the step read
        or wrote, over its leading positions through the last of those."""
        size, end, found = self.block_size, len(seq), []
        kv = self.references.get_kv(_model_tokens(seq))
        for g, group in enumerate(self.config.groups):
            table = request.block_ids[g] if g < len(request.block_ids) else ()
            first = get_read_positions(group, start).start
            for index in range(first // size, -(-end // size)):
                if index >= len(table) or table[index] in bad or table[index] == NULL_BLOCK:
                    continue
                found.append(self._expect(request.request_id, table[index], index, g, kv,
                                          min(size, end - index * size)))
        return found

    def _expect_cached(self, mid: Observation, bad: set[int]):
        """Every prefix-cache entry the oracle does not know to be bad or
        still loading, against the tokens its hash names."""
        skip = bad | self.content.loading_blocks()
        found = []
        for key, block in mid.pool.cached:
            block_hash, g = split_cache_key(key)
            tokens = self.hash_tokens.get(block_hash)
            if block in skip or tokens is None or g >= len(self.config.groups):
                self.stats["cached_blocks_not_checked"] += 1
                continue
            kv = self.references.get_kv(_model_tokens(tokens))
            index = len(tokens) // self.block_size - 1
            found.append(self._expect(CACHE_OWNER, block, index, g, kv, self.block_size))
        return found

    def _expect(self, owner: str, block_id: int, index: int, group: int, kv,
                num_valid: int) -> ExpectedBlock:
        layers = self.cache.group_layers[group]
        sums, scales = compute_expected_checksums(kv, layers, self.block_size, index, num_valid,
                                                  self.cache.dtype)
        return ExpectedBlock(owner, block_id, index, group, num_valid, sums, scales)

    # -- offload ---------------------------------------------------------------

    def _offload(self, step: StepView, mid: Observation, sequences: dict, tainted: set[str],
                 clean: set[int]) -> None:
        """An offloading request's blocks that checked clean go to the store,
        keyed by the tokens they hold (real tokens only, not drafts)."""
        size = self.block_size
        for rid, (start, seq) in sequences.items():
            plan = self.plans.get(rid)
            if plan is None or not plan.offload or rid in tainted:
                continue
            request = mid.requests[rid]
            end = len(seq) - len(step.scheduled_spec_decode_tokens.get(rid, ()))
            keys, blocks = [], []
            for g, table in enumerate(request.block_ids):
                for index in range(-(-end // size)):
                    if index < len(table) and table[index] in clean:
                        keys.append((g, seq[:min((index + 1) * size, end)]))
                        blocks.append(table[index])
            if blocks:
                self.store.save_blocks(keys, self.cache, blocks)
                self.stats["blocks_offloaded"] += len(blocks)

    # -- sampling ----------------------------------------------------------------

    def _row(self, rid: str, position: int) -> torch.Tensor:
        """The logits row that predicts the token at ``position``."""
        start, logits = self.logits[rid]
        return logits[position - 1 - start]

    def count_accepted(self, rid: str, position: int, drafts: Sequence[int]) -> int:
        """Greedy verification: drafts match the model's argmax one after
        another from ``position`` (a padding slot, -1, never does)."""
        if rid not in self.logits:
            return 0
        count = 0
        for k, token in enumerate(drafts):
            if token < 0 or int(self._row(rid, position + k).argmax()) != token:
                break
            self._note_sample(rid, position + k)
            count += 1
        return count

    def greedy_token(self, rid: str, position: int, forced_eos: bool) -> int:
        """The token sampled at ``position``: the model's argmax, or EOS where
        the environment forces it (a stop the client asked for)."""
        if rid not in self.logits:  # its step could not run: a violation says so
            return PAD_TOKEN
        self._note_sample(rid, position)
        if forced_eos:
            self.forced_eos.setdefault(rid, set()).add(position)
            return EOS_TOKEN_ID
        self.forced_eos.get(rid, set()).discard(position)
        return int(self._row(rid, position).argmax())

    def _note_sample(self, rid: str, position: int) -> None:
        self.sampled_rows.setdefault(rid, {})[position] = self._row(rid, position)

    # -- end to end ----------------------------------------------------------------

    def take_violations(self, obs: Observation, final_view) -> list[Violation]:
        """The step's mismatches, and those of every request that ended since
        the last call (``final_view``: the target's view of a departed one)."""
        found, self.violations = self.violations, []
        ended = [r for r in obs.requests.values() if r.status.is_finished]
        for rid in set(self.sampled_rows) - set(obs.requests) - self.ended:
            view = final_view(rid)
            if view is not None:
                ended.append(view)
        for view in ended:
            if view.request_id not in self.ended:
                self.ended.add(view.request_id)
                found += self.check_ended(view)
        return found

    def check_ended(self, view: RequestView) -> list[Violation]:
        """A request that ended: its output tokens are the no-cache model's
        greedy tokens, and each logits row it sampled from is the reference's
        (a request that ended with an error is exempt: policy "fail")."""
        rid = view.request_id
        rows = self.sampled_rows.pop(rid, {})
        forced = self.forced_eos.pop(rid, set())
        self.logits.pop(rid, None)
        if view.status == RequestStatus.FINISHED_ERROR:
            self.stats["requests_ended_with_error"] += 1
            return []
        if not view.output_token_ids:
            return []
        tokens = view.all_token_ids
        reference = self.model.forward_reference(list(tokens))
        self.stats["requests_checked_end_to_end"] += 1
        for position in range(view.num_prompt_tokens, len(tokens)):
            expected = reference[position - 1]
            token = tokens[position]
            if position in forced and token == EOS_TOKEN_ID:
                continue
            # a near tie may break either way under the allowed drift: the
            # token is wrong only if the reference ranks it LOGITS_TOL below the top
            if expected[token] < expected.max() - LOGITS_TOL:
                return [Violation(KV_CLAIM, (
                    f"{rid}: token {position} is {token}, the no-cache model's greedy token is "
                    f"{int(expected.argmax())} ({view.status.name})"), KV_CLAIM_DOC)]
            row = rows.get(position)
            if row is not None and float((row - expected).abs().max()) > LOGITS_TOL:
                return [Violation(KV_CLAIM, (
                    f"{rid}: the logits token {position} was sampled from differ from the "
                    f"no-cache model's by {float((row - expected).abs().max()):.3g} > "
                    f"{LOGITS_TOL}"), KV_CLAIM_DOC)]
        return []

    def close(self) -> None:
        self.loader.close()
