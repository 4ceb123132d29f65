"""``kvspec export-test TRACE``: a trace of the vllm target as a standalone
pytest in vLLM's test style, for attaching to an upstream issue (issue 28, item 7).

The test imports vLLM and vLLM's own test helpers (``tests/v1/kv_connector/unit/
utils.py``), never kvspec. It is recorded, not translated: the trace is replayed
on the installed vLLM with every call into the scheduler and every answer of
kvspec's connector written down, and the test makes the same calls:

- a connector class in the test answers as kvspec's environment did, from a
  per-request script (the prefix the store holds, sync or async, "not yet",
  whether a finished request's blocks are held for a send);
- ``_update`` plays the worker: the tokens kvspec's worker sampled, the loads it
  finished, the block ids whose load failed;
- a ledger of what each KV block holds (written by a step, by a load, or left
  by a failed load) checks kvspec's claims in vLLM's terms after every output:
  the prefix cache serves only KV that was written, a block held for a send is
  not overwritten, ``num_computed_tokens`` stays within the tokens; a drain at
  the end finishes every load and send and asks that every request ends.

A crash needs no check: the call raises as it did. Claims that need kvspec's
full data oracle (several KV cache groups, Mamba state, per-step transition
rules) are refused with the list of what the test can express.
"""
from __future__ import annotations

import keyword
import pprint
import re
from pathlib import Path

import attrs

#: the claims a generated test checks in vLLM's terms (the crash: by raising)
EXPRESSIBLE = {
    "target_crashed": "the call raises as it did",
    "no_caching_of_invalid_blocks": "a ledger of what each block holds",
    "send_source_intact": "no write to a block held for a send",
    "computed_within_tokens": "0 <= num_computed_tokens - placeholders <= num_tokens",
    "every_request_finishes": "a drain that finishes every load and send",
    "every_group_serves_computed": "each group's table holds the blocks a step reads",
}
#: claims that the ledger cannot judge with several KV cache groups
SINGLE_GROUP_ONLY = {"no_caching_of_invalid_blocks", "send_source_intact"}
#: steps the drain at the end of a test takes at most
DRAIN_STEPS = 200


class ExportError(ValueError):
    """The trace cannot be written as a standalone vLLM test."""


@attrs.define
class Recording:
    """A trace's calls into vLLM's scheduler and its connector's answers."""

    config: object
    version: str
    violations: list
    #: ("add", dict) | ("schedule", n) | ("update", n, dict) | ("abort", rid)
    #: | ("reset", running) | ("drafts", dict), in call order
    calls: list = attrs.Factory(list)
    #: request id -> [(num_computed_tokens, answer or None, is_async)]
    answers: dict = attrs.Factory(dict)
    #: request ids whose blocks the connector held for a send when they finished
    sends: set = attrs.Factory(set)
    crashed: bool = False
    #: requests whose connector answers outside the contract on purpose
    offers_again: set = attrs.Factory(set)
    #: the environment the run's connector answered from
    env: object = None
    #: efficiency claims the trace breaks (lost performance: no test is written of it)
    lost: list = attrs.Factory(list)
    #: what the trace broke first, when no claim a test can check was among it:
    #: the recording is then of the same run with those claims unchecked
    first_seen: list = attrs.Factory(list)
    #: the run was replayed on with what the test cannot check unchecked, and
    #: broke nothing it can check
    went_on: bool = False
    #: the vLLM it was recorded on, in words ("vLLM 0.32.0", "vLLM 0.32.0 with
    #: pr.diff applied"); the version alone hid that a review's HEAD was patched
    where: str = ""

    def __attrs_post_init__(self) -> None:
        self.where = self.where or f"vLLM {self.version}"


def record(trace: Path, target: str | None = None) -> Recording:
    """Replay ``trace`` on the vllm target, writing down every call. When what
    it breaks is all beyond a standalone test (the transition model, kvspec's
    ghost state), the run is recorded again with every claim the test cannot
    check left unchecked, so that it goes on to a harm the test can show (a
    garbage block cached, a request that never finishes); the first breaks are
    kept in ``first_seen``."""
    rec = _record(trace, target)
    ignore = () if rec.crashed else get_ignored_to_go_on(
        {v.invariant for v in rec.violations}, rec.config)
    if not ignore:
        return rec
    further = _record(trace, target, ignore)
    if not further.violations:
        rec.went_on = True
        return rec
    further.first_seen = rec.violations
    return further


def _record(trace: Path, target: str | None, ignore=frozenset()) -> Recording:
    from kvspec.harness.replay import replay_trace
    from kvspec.harness.runner import is_lost_performance
    from kvspec.harness.targets import parse_connector_choice
    found: list[Recording] = []

    def start(runner) -> None:
        if not runner.target_name.startswith("vllm"):
            whose = "--target names" if target is not None else "the trace's target is"
            raise ExportError(f"export-test writes vLLM tests: {whose} "
                              f"{runner.target_name!r} (record it on vLLM with --target "
                              "'vllm?fixes=none')")
        choice = parse_connector_choice(runner.target_name)
        if choice is not None:
            raise ExportError(f"export-test writes the answers of kvspec's own connector into a "
                              f"stand-in; this run's answers came from {choice.name}, which "
                              "the test would not call: `kvspec replay` reproduces the trace "
                              "with it")
        found.append(Recording(runner.config, runner.target.version, [], env=runner.env,
                               where=describe_source(runner.target.version)))
        _wrap_scheduler(runner.target.scheduler, found[0])
        _wrap_connector(runner.env, found[0])
    outcome = replay_trace(trace, target, on_start=start, ignore=ignore)
    rec = found[0]
    # a safety or design break stops the run; lost performance alone is no failure
    rec.violations = [v for v in outcome.violations if not is_lost_performance(v)]
    rec.lost = [v for v in outcome.violations if is_lost_performance(v)]
    rec.crashed = any(v.invariant == "target_crashed" for v in rec.violations)
    rec.offers_again = {rid for rid, plan in rec.env.plans.items() if plan.beyond_contract}
    return rec


def _wrap_scheduler(s, rec: Recording) -> None:
    names: dict[int, int] = {}
    depth = [0]  # calls the scheduler makes itself (finish_requests under "fail") are its own

    def outer(method):
        def call(*args, **kwargs):
            depth[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    def add_request(request, *args, **kwargs):
        params = request.sampling_params
        transfer = (getattr(params, "extra_args", None) or {}).get("kv_transfer_params")
        rec.calls.append(("add", dict(
            request_id=request.request_id, prompt=list(request.prompt_token_ids),
            max_tokens=params.max_tokens, priority=request.priority,
            arrival_time=request.arrival_time, kv_transfer_params=transfer)))
        return add(request, *args, **kwargs)

    def schedule(*args, **kwargs):
        n = len(names) + 1
        scheduled: dict = {}  # filled once it returns: a crash leaves it empty
        rec.calls.append(("schedule", n, scheduled))
        out = sched(*args, **kwargs)
        names[id(out)] = n
        scheduled.update(out.num_scheduled_tokens)
        return out

    def update_from_output(out, runner_output):
        kv = runner_output.kv_connector_output
        rec.calls.append(("update", names[id(out)], dict(
            sampled={rid: list(runner_output.sampled_token_ids[i])
                     for rid, i in runner_output.req_id_to_index.items()},
            finished_sending=sorted(getattr(kv, "finished_sending", None) or ()),
            finished_recving=sorted(getattr(kv, "finished_recving", None) or ()),
            invalid_block_ids=sorted(getattr(kv, "invalid_block_ids", None) or ()),
            failed_recving=sorted(getattr(kv, "failed_recving", None) or ()))))
        return update(out, runner_output)

    def finish_requests(request_ids, status, *args, **kwargs):
        if not depth[0]:
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            rec.calls.extend(("abort", rid) for rid in ids)
        return finish(request_ids, status, *args, **kwargs)

    def reset_prefix_cache(*args, **kwargs):
        if not depth[0]:
            rec.calls.append(("reset", bool(kwargs.get("reset_running_requests"))))
        return reset(*args, **kwargs)

    def update_draft_token_ids(draft):
        rec.calls.append(("drafts", dict(zip(draft.req_ids, map(list, draft.draft_token_ids)))))
        return drafts(draft)

    add, sched, update = s.add_request, s.schedule, s.update_from_output
    finish, reset, drafts = s.finish_requests, s.reset_prefix_cache, s.update_draft_token_ids
    s.add_request, s.schedule = outer(add_request), outer(schedule)
    s.update_from_output = outer(update_from_output)
    s.finish_requests, s.reset_prefix_cache = finish_requests, reset_prefix_cache
    s.update_draft_token_ids = outer(update_draft_token_ids)


def _wrap_connector(env, rec: Recording) -> None:
    matched, finished = env.get_num_new_matched_tokens, env.request_finished

    def get_num_new_matched_tokens(request, num_computed_tokens):
        n, is_async = matched(request, num_computed_tokens)
        rec.answers.setdefault(request.request_id, []).append(
            (num_computed_tokens, n, bool(is_async)))
        return n, is_async

    def request_finished(request, block_ids):
        delay, params = finished(request, block_ids)
        if delay:
            rec.sends.add(request.request_id)
        return delay, params

    env.get_num_new_matched_tokens = get_num_new_matched_tokens
    env.request_finished = request_finished


# -- the test's text ----------------------------------------------------------
def get_usable(config) -> frozenset[str]:
    """The claims a standalone test of a run with ``config`` can check."""
    usable = frozenset(EXPRESSIBLE)
    return usable if _checks_blocks(config) else usable - SINGLE_GROUP_ONLY


def get_ignored_to_go_on(claims: set[str], config) -> frozenset[str]:
    """When every broken claim is one a standalone test cannot check: all such
    claims, to leave unchecked so that the run goes on to what a test can show
    (``record``; ``kvspec review`` names the same continuation). Empty when a
    broken claim is one the test checks, or none broke."""
    from kvspec.spec.registry import REGISTRY
    usable = get_usable(config)
    if not claims or claims & usable:
        return frozenset()
    return frozenset(REGISTRY) - usable


def get_unexpressible(rec: Recording) -> list[str]:
    """The broken claims the test cannot check, when none it can is broken."""
    claims = {v.invariant for v in rec.violations}
    return [] if claims & get_usable(rec.config) else sorted(claims)


def render(rec: Recording, trace: Path, test_name: str | None = None) -> str:
    """The standalone test's source."""
    if not rec.violations and rec.lost:
        raise ExportError(
            f"{trace.name}: the trace breaks only efficiency claims on {rec.where} "
            f"(lost performance: {', '.join(sorted({v.invariant for v in rec.lost}))}); "
            "export-test writes tests of safety failures; `kvspec replay` reproduces it")
    if not rec.violations:
        raise ExportError(f"{trace.name}: the trace breaks no claim on {rec.where}: "
                          "nothing to reproduce")
    missing = get_unexpressible(rec)
    if missing:
        went_on = (", and with those unchecked the run goes on to break nothing it checks"
                   if rec.went_on else "")
        raise ExportError(
            f"{trace.name}: a standalone test cannot check {', '.join(missing)} yet (it "
            f"checks {', '.join(sorted(EXPRESSIBLE))}){went_on}; `kvspec replay` "
            "reproduces it")
    name = test_name or get_test_name(trace, rec)
    return "\n".join([_header(rec, trace), HELPERS, _config_code(rec), _body(rec, name)]) + "\n"


#: the stem of a trace a run saved under its own name (``vllm-seed3``,
#: ``review-pr-1234-seed0``): it says how the trace was found, not what it shows
RUN_STEM = re.compile(r".*-seed\d+$")


def get_test_name(trace: Path, rec: Recording | None = None) -> str:
    """A finding's trace names its test (``vllm-0.32.0-x.json``: ``test_x``); a
    trace a run saved as ``...-seed<N>`` is named by what it breaks
    (``test_no_caching_of_invalid_blocks``), the first claim the test checks."""
    stem = re.sub(r"^vllm-[0-9.]+-", "", trace.stem)
    claims = sorted({v.invariant for v in rec.violations} & set(EXPRESSIBLE)) if rec else []
    if RUN_STEM.match(stem) and claims:
        stem = claims[0]
    name = "test_" + re.sub(r"\W+", "_", stem).strip("_").lower()
    return name if name.isidentifier() and not keyword.iskeyword(name) else "test_kvspec_trace"


def describe_source(version: str) -> str:
    """The vLLM a recording runs on, in words: a patched tree by its patch."""
    from kvspec.harness.vllm_source import active
    source = active()
    if source.kind == "patched" and source.patch:
        return f"vLLM {version} with {Path(source.patch).name} applied"
    return f"vLLM {version}" + ("" if source.is_installed or source.kind == "wheel"
                                else f" ({source.where()})")


def _released_note(rec: Recording) -> str:
    return ("" if rec.where == f"vLLM {rec.version}" else
            f"\nOn vLLM {rec.version} as released it need not fail: the patch is the change.")


def get_first_seen_line(v) -> str:
    """A first break for the docstring, in a vLLM maintainer's words."""
    if v.invariant == "transition_admitted_by_model":
        step = v.message.removesuffix(" is admitted by no shape of spec/effects.py")
        return ("  a step no path of kvspec's model of the scheduler allows (its "
                f"transition_admitted_by_model):\n    {step}")
    return f"  {v.invariant}: {v.message}"


def _header(rec: Recording, trace: Path) -> str:
    broke = "\n".join(f"  {v.invariant}: {v.message}" for v in rec.violations[:6])
    if rec.first_seen:
        first = "\n".join(get_first_seen_line(v) for v in rec.first_seen[:6])
        broke = (f"{first}\n\nA standalone test cannot check that; with it (and every claim "
                 "such a test cannot\ncheck) left unchecked, the same run goes on to break "
                 f"what this test checks:\n\n{broke}")
    if re.search(r"\bblocks? \d", broke):
        broke += ("\n\n(kvspec numbers blocks from 0; vLLM's block ids, in the test's "
                  "messages, are one\nhigher: its block 0 is the null block.)")
    how = ("raises" if rec.crashed else "fails an assertion")
    return f'''# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A scheduler run that kvspec found breaking its claims on {rec.where}:

{broke}

Written by `kvspec export-test {trace.name}`; it imports no kvspec. The
connector below answers as kvspec's environment did, `_update` plays the
worker (the tokens it sampled, the loads it finished, the blocks whose load
failed), and a ledger of what each KV block holds checks after every output
that the prefix cache serves only KV that was written, that no block held for
a send is overwritten and that num_computed_tokens stays within the tokens.
Every KV cache group must hold the blocks a request's next step reads.
The run ends with a drain that finishes every load and send; every request
must then have finished. Put the file in tests/v1/kv_connector/unit/; on
{rec.where} it {how}.{_released_note(rec)}
"""'''


HELPERS = '''
import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from .utils import create_scheduler, create_vllm_config

pytestmark = pytest.mark.cpu_test

EOS_TOKEN_ID = 0


def _token(request_id: str, position: int) -> int:
    """The model's token at a position (what kvspec's worker samples)."""
    return 1 + (sum(map(ord, request_id)) * 31 + position * 17) % 7


class ScriptedConnector(KVConnectorBase_V1):
    """Answers get_num_new_matched_tokens from SCRIPT: per request, in order,
    (num_computed_tokens, external tokens or None for "not yet", is_async).
    Past the script it offers the prefix its last answer reached (a scheduler
    that asks from elsewhere gets the same store), except that a load which
    landed is not offered again before a preemption (unless the request is in
    OFFERS_AGAIN, as kvspec's connector did on purpose). request_finished holds the
    blocks of the requests in SENDS for a send."""

    SCRIPT: dict = {}
    SENDS: set = set()
    OFFERS_AGAIN: set = set()  # requests whose connector steps outside the contract

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.asked: dict = {}
        self.loads: list = []  # (request id, start, tokens, block ids, is_async)
        self.last_answer: dict = {}
        self.starts: dict = {}  # request id -> where its latest load starts
        self.delivered: dict = {}  # request id -> its preemptions when a load of it landed

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        rid = request.request_id
        script = self.SCRIPT.get(rid, [])
        i = self.asked[rid] = self.asked.get(rid, -1) + 1
        if i < len(script):
            at, n, is_async = script[i]
            if n is None:
                return None, False
            stored = at + n
        elif (self.delivered.get(rid) == request.num_preemptions
              and rid not in self.OFFERS_AGAIN):
            stored, is_async = 0, False  # its load finished: not offered again
        else:
            stored, is_async = self.last_answer.get(rid, (0, False))
        n = max(0, stored - num_computed_tokens)
        self.last_answer[rid] = (stored, is_async)
        self.starts[rid] = num_computed_tokens
        return n, is_async and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0:
            _, is_async = self.last_answer[request.request_id]
            self.loads.append((request.request_id, self.starts[request.request_id],
                               num_external_tokens,
                               list(blocks.get_block_ids()[0]), is_async))

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        groups = block_ids if block_ids and isinstance(block_ids[0], (list, tuple)) \\
            else [block_ids]
        self.ledger.cancel_load(request.request_id)  # a load in flight is dropped
        if request.request_id in self.SENDS and any(groups):
            self.ledger.start_send(request.request_id, groups[0])
            return True, {}
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids)

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


class ScriptedHMAConnector(ScriptedConnector, SupportsHMA):
    """The same, for several KV cache groups."""


class Ledger:
    """What each KV block holds, as the worker wrote it."""

    def __init__(self, scheduler, block_size, check_blocks=True):
        self.scheduler, self.block_size = scheduler, block_size
        #: the block checks follow the first KV cache group alone: off with several
        self.check_blocks = check_blocks
        self.slots: dict = {}  # (block id, offset) -> (request id, position) or "garbage"
        self.tokens: dict = {}  # request id -> its token ids, as last seen
        self.hashes: dict = {}  # request id -> its block hashes, as last seen
        self.writes: dict = {}  # scheduler output -> its writes
        self.samples: dict = {}  # scheduler output -> the requests it samples
        self.loads: dict = {}  # scheduler output -> the sync loads it runs
        self.async_loads: dict = {}  # request id -> its async load in flight
        self.sending: dict = {}  # request id -> the blocks held for its send
        self.in_flight: list = []

    def note_schedule(self, out, connector):
        self.samples[id(out)] = {  # a step that reaches the end of the prompt samples
            rid for rid in out.num_scheduled_tokens
            if self.scheduler.requests[rid].num_computed_tokens
            >= self.scheduler.requests[rid].num_prompt_tokens}
        self.writes[id(out)] = [
            (rid, self.scheduler.requests[rid].num_computed_tokens - n, n,
             list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0]))
            for rid, n in out.num_scheduled_tokens.items()]
        self.loads[id(out)] = [x for x in connector.loads if not x[4]]
        self.async_loads.update((x[0], x) for x in connector.loads if x[4])
        connector.loads.clear()
        self.in_flight.append(out)
        self.remember()

    def cancel_load(self, request_id):
        self.async_loads.pop(request_id, None)

    def start_send(self, request_id, block_ids):
        self.sending[request_id] = set(block_ids)

    def write(self, block, offset, what):
        # a step of the sender itself, scheduled before it finished, ran
        # before its send on the worker's stream
        for rid, held in self.sending.items() if self.check_blocks else ():
            assert block not in held or what == "garbage" or what[0] == rid, (
                f"block {block} was overwritten while its KV was being sent for {rid}")
        self.slots[(block, offset)] = what

    def slot(self, blocks, position):
        return blocks[position // self.block_size], position % self.block_size

    def land(self, load, invalid):
        rid, start, n, blocks, _ = load
        for p in range(start, start + n):
            block = blocks[p // self.block_size]
            self.write(block, p % self.block_size, (rid, p))
            if block in invalid:
                self.slots[(block, p % self.block_size)] = "garbage"

    def note_output(self, out, finished_sending, finished_recving, invalid):
        self.in_flight.remove(out)
        self.samples.pop(id(out))
        for load in self.loads.pop(id(out)):
            self.land(load, invalid)
        for rid in finished_recving:
            if rid in self.async_loads:
                load = self.async_loads.pop(rid)
                self.land(load, invalid)
                request = self.scheduler.requests.get(rid)
                if request is not None and not invalid & set(load[3]):
                    self.scheduler.connector.delivered[rid] = request.num_preemptions
        for rid, start, n, blocks in self.writes.pop(id(out)):
            # a step attends to the KV before it: over a prefix that is not the
            # request's, what it writes is not what its tokens' hashes name
            valid = all(self.holds(self.slots.get(self.slot(blocks, q))) == self.tokens[rid][q]
                        for q in range(start))
            for p in range(start, start + n):
                self.write(*self.slot(blocks, p), (rid, p) if valid else "garbage")
        for rid in finished_sending:
            self.sending.pop(rid, None)

    def remember(self):
        for rid, request in self.scheduler.requests.items():
            self.tokens[rid] = list(request.all_token_ids)
            self.hashes[rid] = list(request.block_hashes)

    def pending(self):
        """The slots steps in flight write: vLLM caches a block when the step
        that fills it is scheduled, and a step that reads it runs after that
        one on the worker. Judged as written until the step's output lands."""
        return {self.slot(blocks, p): (rid, p)
                for out in self.in_flight for rid, start, n, blocks in self.writes[id(out)]
                for p in range(start, start + n)}

    def holds(self, what):
        if what == "garbage" or what is None:
            return what
        rid, p = what
        return self.tokens[rid][p] if p < len(self.tokens[rid]) else None

    def check(self):
        """After an output: kvspec's claims, in vLLM's terms."""
        self.remember()
        pool = self.scheduler.kv_cache_manager.block_pool
        pending = self.pending()
        for rid, hashes in self.hashes.items() if self.check_blocks else ():
            for i, block_hash in enumerate(hashes):
                cached = pool.get_cached_block(block_hash, [0])
                if not cached:
                    continue
                want = self.tokens[rid][i * self.block_size:(i + 1) * self.block_size]
                got = [self.holds(pending.get((cached[0].block_id, j),
                                              self.slots.get((cached[0].block_id, j))))
                       for j in range(self.block_size)]
                assert got == want, (
                    f"block {cached[0].block_id} is in the prefix cache under the hash "
                    f"of {rid}'s block {i} (tokens {want}), but it holds {got} "
                    "(None: never written; 'garbage': a failed load)")
        self.check_groups()
        if self.in_flight:  # placeholders of steps in flight count as computed
            return
        for rid, request in self.scheduler.requests.items():
            real = request.num_computed_tokens - request.num_output_placeholders
            assert 0 <= real <= request.num_tokens, (
                f"{rid}: num_computed_tokens={request.num_computed_tokens} "
                f"(placeholders {request.num_output_placeholders}) of "
                f"{request.num_tokens} tokens")


    def check_groups(self):
        """In every KV cache group the blocks a request's next step reads hold a
        block, not the null block: full attention every block of its computed
        prefix, a sliding window of w tokens those of its last w - 1 positions,
        a Mamba group the block of the state after its last computed token."""
        manager = self.scheduler.kv_cache_manager
        null = manager.block_pool.null_block.block_id
        specs = [g.kv_cache_spec for g in manager.kv_cache_config.kv_cache_groups]
        for rid, request in self.scheduler.requests.items():
            if request.is_finished():
                continue
            real = request.num_computed_tokens - request.num_output_placeholders
            for g, table in enumerate(manager.get_block_ids(rid)):
                window = getattr(specs[g], "sliding_window", None)
                first = (real - (window - 1) if window
                         else real - 1 if "Mamba" in type(specs[g]).__name__ else 0)
                read = sorted({p // specs[g].block_size for p in range(max(0, first), real)})
                missing = [i for i in read if i >= len(table) or table[i] == null]
                assert not missing, (
                    f"{rid}: group {g} ({type(specs[g]).__name__}) reads block {missing[0]} "
                    f"from {real} computed tokens, but its table holds no block there: "
                    f"{list(table)}")


def _request(request_id, prompt, max_tokens, priority=0, arrival_time=0.0,
             kv_transfer_params=None):
    params = SamplingParams(max_tokens=max_tokens)
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(request_id=request_id, prompt_token_ids=prompt,
                   sampling_params=params, pooling_params=None, priority=priority,
                   arrival_time=arrival_time,
                   block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256))


def _schedule(scheduler):
    out = scheduler.schedule()
    scheduler.ledger.note_schedule(out, scheduler.connector)
    return out


def _update(scheduler, out, sampled, finished_sending=(), finished_recving=(),
            invalid_block_ids=(), failed_recving=()):
    """The worker's output for `out`: `sampled` as recorded; a request that
    a scheduler schedules where the recording has none samples if the step
    reached the end of its prompt. A recorded finished load is reported only
    for a request with a load in flight here (waiting for it, or ended while
    it ran): a scheduler that admits differently (a fix) may not have started
    it, and a worker reports only the loads it ran."""
    finished_recving = {rid for rid in finished_recving if _has_load_in_flight(scheduler, rid)}
    req_ids = list(out.num_scheduled_tokens)
    tokens = []
    for rid in req_ids:
        request = scheduler.requests.get(rid)
        if rid in sampled:
            tokens.append(list(sampled[rid]))
        elif request is not None and rid in scheduler.ledger.samples[id(out)]:
            tokens.append([_token(rid, request.num_tokens)])
        else:
            tokens.append([])
    kv = KVConnectorOutput(finished_sending=set(finished_sending) or None,
                           finished_recving=set(finished_recving) or None,
                           invalid_block_ids=set(invalid_block_ids))
    if failed_recving:
        kv.failed_recving = set(failed_recving)
    output = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=tokens, logprobs=None, prompt_logprobs_dict={},
        pooler_output=[], kv_connector_output=kv)
    scheduler.update_from_output(out, output)
    scheduler.ledger.note_output(out, finished_sending, finished_recving,
                                 set(invalid_block_ids))
    scheduler.ledger.check()


def _has_load_in_flight(scheduler, rid):
    request = scheduler.requests.get(rid)
    return request is not None and (request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                                    or RequestStatus.is_finished(request.status))


def _healed(scheduler, out):
    """An output in which every load and every send in flight finishes."""
    loading = {rid for rid, r in scheduler.requests.items()
               if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
    _update(scheduler, out, {}, finished_sending=set(scheduler.ledger.sending),
            finished_recving=loading | set(scheduler.ledger.async_loads))


def _drain(scheduler, max_steps):
    """Run to the end with every load and send finishing: outputs still in
    flight first, then one step at a time."""
    for out in list(scheduler.ledger.in_flight):
        _healed(scheduler, out)
    for _ in range(max_steps):
        if not scheduler.requests:
            return
        _healed(scheduler, _schedule(scheduler))
    left = {rid: (r.status.name, r.num_computed_tokens, r.num_tokens)
            for rid, r in scheduler.requests.items()}
    assert not left, (f"after {max_steps} steps with every load and send finished, "
                      f"requests are left (status, computed, tokens): {left}")
'''


def _config_code(rec: Recording) -> str:
    c = rec.config
    lines = ["", "", f"BLOCK_SIZE = {c.scheduler_block_size}",
             f"HASH_BLOCK_SIZE = {c.hash_block_size}", "", "",
             "def _make_scheduler(script, sends, offers_again=()):",
             '    """kvspec\'s configuration of the run, through vLLM\'s test helpers."""',
             "    init_none_hash(sha256)",
             "    vllm_config = create_vllm_config(",
             f"        max_num_seqs={c.max_num_seqs},",
             f"        max_num_batched_tokens={c.max_num_batched_tokens},",
             "        block_size=BLOCK_SIZE,",
             f"        max_model_len={c.max_model_len},",
             f"        kv_load_failure_policy={c.kv_load_failure_policy!r},",
             f"        kv_connector={_connector_class(c)!r},",
             "        kv_connector_module_path=__name__,",
             f"        kv_role={c.kv_role!r},",
             f"        disable_hybrid_kv_cache_manager={len(c.groups) == 1},"]
    # as the vllm target: sync drafts need spec decode configured, except beside a
    # last-state group, where the target draws none (vllm_target.NO_DRAFTS_WITH_STATE)
    if not c.async_scheduling and not any(g.kind == "last_state" for g in c.groups):
        lines.append("        num_speculative_tokens=2,  # drafts reach the scheduler")
    elif c.num_speculative_tokens:
        lines.append(f"        num_speculative_tokens={c.num_speculative_tokens},")
    lines.append("    )")
    lines += _settings_code(c)
    lines += _groups_code(c)
    lines += [f"    scheduler = create_scheduler(vllm_config, num_blocks={c.num_blocks + 1},"
              " kv_cache_config=kv_cache_config" + (", hash_block_size=HASH_BLOCK_SIZE"
                                                    if c.hash_block_size != c.block_size
                                                    else "") + ")",
              "    connector = scheduler.connector",
              "    connector.SCRIPT, connector.SENDS = script, set(sends)",
              "    connector.OFFERS_AGAIN = set(offers_again)",
              "    scheduler.ledger = scheduler.connector.ledger = Ledger(",
              f"        scheduler, BLOCK_SIZE, check_blocks={_checks_blocks(c)})",
              "    return scheduler"]
    return "\n".join(lines)


def _checks_blocks(c) -> bool:
    """The ledger follows one group's blocks, hashed in blocks of its size."""
    return len(c.groups) == 1 and c.hash_block_size == c.block_size


def _connector_class(c) -> str:
    return "ScriptedHMAConnector" if len(c.groups) > 1 else "ScriptedConnector"


def _settings_code(c) -> list[str]:
    lines = ["    # the helper sizes the model from opt-125m's config: the run's length",
             f"    vllm_config.model_config.max_model_len = {c.max_model_len}",
             "    sc = vllm_config.scheduler_config",
             f"    sc.policy = {c.policy!r}"]
    if c.long_prefill_token_threshold:
        lines.append(f"    sc.long_prefill_token_threshold = {c.long_prefill_token_threshold}")
    if c.long_prefill_token_threshold_adaptive:
        lines.append("    sc.long_prefill_token_threshold_adaptive = True")
    if c.async_scheduling:
        lines.append("    sc.async_scheduling = True  # two steps in flight")
    if not c.enable_prefix_caching:
        lines.append("    vllm_config.cache_config.enable_prefix_caching = False")
    if not c.kv_connector:
        raise ExportError("the run has no KV connector: export-test writes tests on vLLM's "
                          "KV-connector unit-test helpers (tests/v1/kv_connector/unit); "
                          "`kvspec replay` reproduces this trace")
    if any(g.kind == "last_state" for g in c.groups):
        lines.append('    vllm_config.cache_config.mamba_cache_mode = "align"')
    return lines


def _groups_code(c) -> list[str]:
    if len(c.groups) == 1 and c.groups[0].kind == "full_attention":
        return ["    kv_cache_config = None  # one full-attention group (the helper's)"]
    specs = []
    for g in c.groups:
        common = f"block_size={g.block_size}, num_kv_heads=1, head_size=8, dtype=torch.float32"
        if g.kind == "full_attention":
            specs.append(f"FullAttentionSpec({common})")
        elif g.kind == "sliding_window":
            specs.append(f"SlidingWindowSpec({common}, sliding_window={g.sliding_window})")
        else:
            specs.append(f"MambaSpec(block_size={g.block_size}, shapes=((1,),), "
                         "dtypes=(torch.float32,), mamba_cache_mode=\"align\", "
                         "num_speculative_blocks=0)")
    lines = ["    import torch",
             "    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,",
             "                                            KVCacheGroupSpec, MambaSpec,",
             "                                            SlidingWindowSpec)",
             "    kv_cache_config = KVCacheConfig(",
             f"        num_blocks={c.num_blocks + 1}, kv_cache_tensors=[],",
             "        kv_cache_groups=["]
    lines += [f"            KVCacheGroupSpec([\"layer{i}\"], {s})," for i, s in enumerate(specs)]
    lines += ["        ])",
              "    # as vLLM's engine resolves them for these groups",
              "    kv_cache_config.hash_block_size = HASH_BLOCK_SIZE",
              "    kv_cache_config.cache_hit_alignment_tokens = BLOCK_SIZE"]
    return lines


def _body(rec: Recording, name: str) -> str:
    script = {rid: [tuple(a) for a in answers] for rid, answers in rec.answers.items()}
    lines = ["", "", f"def {name}():",
             "    # the connector's answers: (num_computed_tokens, external tokens, is_async)",
             f"    script = {_literal(script, 13)}",
             f"    scheduler = _make_scheduler(script, sends={sorted(rec.sends)!r}"
             + (f", offers_again={sorted(rec.offers_again)!r})" if rec.offers_again else ")")]
    lines += ["    " + line for call in rec.calls for line in _call_code(call)]
    if not rec.crashed:
        lines.append(f"    _drain(scheduler, max_steps={DRAIN_STEPS})")
    return "\n".join(lines)


def _call_code(call) -> list[str]:
    kind = call[0]
    if kind == "add":
        a = call[1]
        extra = "".join(f", {k}={a[k]!r}" for k in ("priority", "kv_transfer_params")
                        if a[k])
        line = (f"scheduler.add_request(_request({a['request_id']!r}, {a['prompt']!r}, "
                f"max_tokens={a['max_tokens']}, arrival_time={a['arrival_time']!r}{extra}))")
        if len(line) <= 84:
            return [line]
        return ["scheduler.add_request(_request(",
                f"    {a['request_id']!r},",
                f"    {_literal(a['prompt'], 8)},",
                f"    max_tokens={a['max_tokens']}, arrival_time={a['arrival_time']!r}{extra},",
                "))"]
    if kind == "schedule":
        said = f"  # scheduled: {call[2]}" if call[2] else ""
        return [f"out{call[1]} = _schedule(scheduler){said}"]
    if kind == "update":
        u = call[2]
        args = "".join(f", {k}={set(u[k])!r}" for k in (
            "finished_sending", "finished_recving", "invalid_block_ids", "failed_recving")
            if u[k])
        return [f"_update(scheduler, out{call[1]}, sampled={u['sampled']!r}{args})"]
    if kind == "abort":
        return [f"scheduler.finish_requests({call[1]!r}, RequestStatus.FINISHED_ABORTED)"]
    if kind == "reset":
        arg = "reset_running_requests=True" if call[1] else ""
        return [f"scheduler.reset_prefix_cache({arg})"]
    if kind == "drafts":
        ids = list(call[1])
        return [f"scheduler.update_draft_token_ids(DraftTokenIds({ids!r}, "
                f"{[call[1][r] for r in ids]!r}))"]
    raise AssertionError(kind)


def _literal(value, indent: int) -> str:
    text = pprint.pformat(value, width=88 - indent, sort_dicts=True)
    return text.replace("\n", "\n" + " " * indent)
