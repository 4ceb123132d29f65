"""One vLLM scheduler that someone else drives (a test of vLLM's own suite),
watched: kvspec's state after every call, and each call as a transition of the
spec's relations, rebuilt from what the calls passed and returned.

What a bare scheduler lets kvspec judge is less than what its own harness
judges: no data oracle (nobody wrote KV), no connector answers (the test's
connector is its own), no healed phase. ``BARE_CLAIMS`` are the claims judged
here; ``get_not_evaluated`` says of every other claim why not. A test that
drives the scheduler outside the engine's contract (a request put into
``running`` by hand, a token for a partial prefill chunk) is named with the
reason; its breaks are not counted (``TestRecord.verdict``). The pytest side
is ``kvspec/observe.py``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from unittest.mock import NonCallableMock

import attrs

import kvspec.spec.catalogue  # noqa: F401  (registers every claim)
from kvspec.harness.vllm_config_map import Unmappable, get_config
from kvspec.harness.vllm_observe import NULL_BLOCKS, VllmObserver
from kvspec.spec import history
from kvspec.spec.actions import Transition
from kvspec.spec.history import Ghost
from kvspec.spec.invariants import Context
from kvspec.spec.registry import REGISTRY, evaluate
from kvspec.spec.state import Observation, RequestStatus, WorkerOutcome
from kvspec.spec.worker import apply_scheduler_output

#: claims that need what only kvspec's own environment knows, and why
NOT_ON_A_BARE_SCHEDULER = {
    "placeholders_match_in_flight": "needs the shares of the steps in flight the harness keeps",
}
#: judged only while every output applied came for a step the watch saw
#: scheduled (a hand-made ``SchedulerOutput`` does not say where tokens land),
#: and no async step with drafts was applied (``Watch.note_sampled``)
SAMPLING_CLAIM = "output_is_the_sampled_sequence"
#: why claims of the other kinds are not evaluated on a watched scheduler
NOT_OF_THIS_KIND = {
    "data": "needs the worker's KV content (the data oracle), which a bare scheduler has not",
    "model": "needs the connector's answers the environment gives",
    "liveness": "needs the healed phase the harness drives",
}
#: state claims, after every watched call
STATE_CLAIMS = tuple(name for name, inv in REGISTRY.items()
                     if inv.kind == "state" and name not in NOT_ON_A_BARE_SCHEDULER)
#: relations, on each call's transition (the state before and after it; for a
#: step, its ``SchedulerOutput`` and ``ModelRunnerOutput`` mapped)
RELATIONS = tuple(name for name, inv in REGISTRY.items() if inv.kind == "relation")
#: every claim evaluated on a watched scheduler
BARE_CLAIMS = STATE_CLAIMS + RELATIONS
#: the statuses a request may have when the engine adds it
ADDED_STATUSES = ("WAITING", "WAITING_FOR_FSM", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR")


def get_not_evaluated() -> dict[str, str]:
    """Every registered claim a watch does not evaluate, with why."""
    return {name: NOT_ON_A_BARE_SCHEDULER.get(name) or NOT_OF_THIS_KIND.get(inv.kind, "")
            for name, inv in REGISTRY.items() if name not in BARE_CLAIMS}


@attrs.define
class TestRecord:
    nodeid: str
    schedulers: int = 0
    mapped: int = 0
    unmappable: list[str] = attrs.Factory(list)
    calls: int = 0
    violations: list[dict] = attrs.Factory(list)
    out_of_contract: list[str] = attrs.Factory(list)
    #: the test's own result (passed, failed, skipped), kvspec aside
    outcome: str = "not run"

    def note_violation(self, claim: str, call: str, message: str) -> None:
        """The first break of each claim, and how often it broke (a broken pool
        can break a claim for every block after every call)."""
        first = next((v for v in self.violations if v["claim"] == claim), None)
        if first is None:
            self.violations.append({"claim": claim, "call": call, "message": message,
                                    "count": 1})
        else:
            first["count"] += 1

    def note_out_of_contract(self, reason: str) -> None:
        if reason not in self.out_of_contract:
            self.out_of_contract.append(reason)

    @property
    def verdict(self) -> str:
        if not self.mapped:
            return "unmapped" if self.schedulers else "no scheduler"
        if self.out_of_contract:
            return "out of contract"
        return "violation" if self.violations else "clean"


def get_outcome(model_output) -> WorkerOutcome:
    """A ``ModelRunnerOutput`` as kvspec's ``WorkerOutcome``."""
    tokens = dict(zip(getattr(model_output, "req_ids", ()) or (),
                      getattr(model_output, "sampled_token_ids", ()) or ()))
    kv = getattr(model_output, "kv_connector_output", None)

    def ids(name):
        return frozenset(getattr(kv, name, None) or ())
    return WorkerOutcome(
        sampled_token_ids={rid: tuple(t) for rid, t in tokens.items()},
        finished_recving=ids("finished_recving"), finished_sending=ids("finished_sending"),
        invalid_block_ids=frozenset(b - NULL_BLOCKS for b in ids("invalid_block_ids")))


def without(obs: Observation, ids) -> Observation:
    """``obs`` with the requests ``ids`` left out (to judge one of several
    aborts of one call on its own)."""
    return attrs.evolve(obs, requests={rid: r for rid, r in obs.requests.items()
                                       if rid not in ids})


@attrs.define
class Launched:
    """A step ``schedule()`` returned, until its output is applied."""
    out: object
    step: object
    #: each scheduled request's start and known tokens then
    started: dict
    #: each scheduled request's preemptions then (more later: its output is stale)
    preemptions: dict


# -- watching one scheduler ---------------------------------------------------------
class Watch:
    """One scheduler, judged after every watched call."""

    def __init__(self, scheduler, record: TestRecord | None) -> None:
        from kvspec.harness.vllm_target import modules
        self.record = record
        self.observer = VllmObserver(modules(), get_config(scheduler))
        self.observer.scheduler = scheduler
        #: the KV cache manager the scheduler was built with (the map is of it)
        self.manager = scheduler.kv_cache_manager
        self.ghost = Ghost()
        #: requests some schedule() call returned
        self.scheduled: set[str] = set()
        #: steps launched, by the id of their ``SchedulerOutput``
        self.launched: dict[int, Launched] = {}
        #: the worker's block tables, from the scheduler outputs alone
        self.tables: dict = {}
        #: requests a reported load failure may lower the stats of (at the next check)
        self.lowered_ok: frozenset = frozenset()
        #: the state before the call being made, and what the call was given
        self.before_obs: Observation | None = None
        self.args: tuple = ()
        self.kwargs: dict = {}
        #: the ``ModelRunnerOutput`` being applied, as kvspec's outcome
        self.outcome: WorkerOutcome | None = None
        #: the pool as the last watched call left it
        self.pool_seen: tuple | None = None
        #: every output applied so far came for a step this watch saw scheduled
        self.sampling_known = True
        #: request id -> the last prefix lookup's answer (num_local, num_external)
        self.answers: dict[str, tuple[int, int]] = {}
        self.watch_lookups()

    def note_out_of_contract(self, reason: str) -> None:
        if self.record is not None:
            self.record.note_out_of_contract(reason)

    # -- the prefix lookups ----------------------------------------------------------
    def watch_lookups(self) -> None:
        """Hear every prefix lookup the scheduler makes: the local cache's
        (``get_computed_blocks``) and the connector's (``get_num_new_matched_tokens``,
        given the local count). Whatever a test replaced with a mock is left alone
        (the test configures and inspects it)."""
        s = self.observer.scheduler
        wrap_method(s.kv_cache_manager, "get_computed_blocks", self.heard_local)
        if getattr(s, "connector", None) is not None:
            wrap_method(s.connector, "get_num_new_matched_tokens", self.heard_external)

    def heard_local(self, args, result) -> None:
        """Without a connector the local hit is the whole answer; with one,
        the connector's answer (given the local count) follows, if it is heard."""
        rid = args[0].request_id
        if getattr(self.observer.scheduler, "connector", None) is None:
            self.answers[rid] = (result[1], 0)
        else:
            self.answers.pop(rid, None)

    def heard_external(self, args, result) -> None:
        external = result[0] if isinstance(result, tuple) else None
        if getattr(args[0], "skip_reading_prefix_cache", False) is True:
            external = 0  # vLLM takes no hit for it, whatever the connector says
        if isinstance(external, int):  # None: the connector cannot answer yet
            self.answers[args[0].request_id] = (args[1], external)

    # -- judging ----------------------------------------------------------------------
    def check(self, call: str, obs: Observation, transitions=(), synced: bool = True,
              after_step: bool = False) -> None:
        """Judge the state ``obs`` the call left, and the call's transitions."""
        self.check_mappable()
        history.process_observation(self.ghost, obs, self.answers, self.lowered_ok)
        self.lowered_ok = frozenset()
        self.pool_seen = (obs.pool.ref_cnt, obs.pool.free_queue)
        if self.record is None:
            return
        self.record.calls += 1
        ctx = Context(obs, self.ghost, None, synced=synced, after_step=after_step)
        for name in STATE_CLAIMS:
            if name != SAMPLING_CLAIM or self.sampling_known:
                self.note(name, call, ctx)
        for t in transitions:
            for name in RELATIONS:
                if REGISTRY[name].applies_to(t.action):
                    self.note(name, call, t)

    def note(self, name: str, call: str, subject) -> None:
        messages, _ = evaluate(REGISTRY[name], subject)
        for m in messages:
            self.record.note_violation(name, call, m)

    def get_transition(self, action: str, after: Observation, before=None, **kw) -> Transition:
        before = before or self.before_obs
        departed = {rid: v for rid in before.requests if rid not in after.requests
                    for v in [self.observer.final_view(rid)] if v is not None}
        return Transition(action, before, after, departed=departed,
                          first_hits=dict(self.ghost.first_hits),
                          recovered=frozenset(self.ghost.recovered), **kw)

    # -- before each call ------------------------------------------------------------
    def before(self, name: str, args, kwargs) -> None:
        self.check_mappable()
        self.watch_lookups()  # a test may have swapped the connector
        self.note_hand_placed()
        self.note_mocked_methods()
        self.note_pool_changed_by_hand()
        self.args = tuple(args) + tuple(kwargs.values())
        self.kwargs = dict(kwargs)
        self.before_obs = self.observer.observe()
        if name == "add_request":
            self.before_add(self.args[0])
        elif name == "update_from_output":
            self.before_output(*self.args[:2])
        elif name == "finish_requests":
            self.before_finish(self.args[0] if self.args else None)

    def before_add(self, request) -> None:
        if getattr(request, "resumable", False):
            raise Unmappable("a streaming (resumable) session, whose prompt grows between "
                             "runs: kvspec does not model it")
        if request.num_computed_tokens:
            self.note_out_of_contract("a request added with num_computed_tokens already set")
        if request.status.name not in ADDED_STATUSES:
            self.note_out_of_contract(f"a request added in status {request.status.name} "
                                      "(the scheduler sets it, not the caller)")
        self.observer.note_request(request)
        # output it arrives with (a resumed session's) is the engine's to give
        history.process_sampled(self.ghost, request.request_id, request.num_prompt_tokens,
                                tuple(request.output_token_ids))

    def before_output(self, out, model_output) -> None:
        launched = self.launched.get(id(out))
        started = launched.started if launched is not None and launched.out is out else {}
        outcome = self.outcome = get_outcome(model_output)
        self.note_output_contract(out, started, outcome)
        self.note_sampled(started, out, outcome)
        obs = self.before_obs
        self.lowered_ok = frozenset(outcome.finished_recving | {
            r.request_id for r in obs.requests.values()
            if outcome.invalid_block_ids & {b for t in r.block_ids for b in t}})
        history.process_loads_finished(self.ghost, outcome.finished_recving)

    def note_sampled(self, started: dict, out, outcome: WorkerOutcome) -> None:
        """Where each request's sampled tokens land: after its scheduled
        positions, less the drafts they verify (as the model runner samples)."""
        for rid, tokens in outcome.sampled_token_ids.items():
            drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            if rid not in started or rid not in out.num_scheduled_tokens or (
                    drafts and self.observer.config.async_scheduling):
                # async with drafts, where a token lands depends on the drafts the
                # steps before it in flight rejected, which the watch does not replay
                self.sampling_known = self.sampling_known and not tokens
                continue
            position = started[rid][0] + out.num_scheduled_tokens[rid] - drafts
            history.process_sampled(self.ghost, rid, position, tokens)

    def note_output_contract(self, out, started: dict, outcome: WorkerOutcome) -> None:
        """What only a test's hand-made output does: the model runner samples a
        token at a prompt's last chunk and after, and at least one per draft step."""
        for rid, n in out.num_scheduled_tokens.items():
            start, known = started.get(rid, (None, None))
            if start is None:
                continue
            drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            sampled = len(outcome.sampled_token_ids.get(rid, ()))
            if start + n - drafts < known and sampled:
                self.note_out_of_contract("a sampled token for a partial prefill chunk")
            if start + n - drafts >= known and drafts and not sampled:
                self.note_out_of_contract("no token for a spec-decode step (the model "
                                          "runner samples at least the bonus token)")

    def before_finish(self, request_ids) -> None:
        for rid in self.get_finished_ids(request_ids):
            history.process_abort(self.ghost, self.before_obs.requests.get(rid))

    def get_finished_ids(self, request_ids) -> list[str]:
        if request_ids is None:
            return list(self.before_obs.requests)
        return [request_ids] if isinstance(request_ids, str) else list(request_ids)

    # -- after each call -------------------------------------------------------------
    def after(self, name: str, result) -> None:
        after = self.observer.observe()
        if name == "schedule":
            self.after_schedule(result, after)
        elif name == "update_from_output":
            self.after_output(after)
        elif name == "add_request":
            rid = self.args[0].request_id
            self.check(name, after, [self.get_transition("add", after, request_id=rid)])
        elif name == "finish_requests":
            self.check(name, after, self.get_abort_transitions(after))
        elif name == "reset_prefix_cache":
            forced = bool(self.kwargs.get("reset_running_requests",
                                          self.args[0] if len(self.args) > len(self.kwargs)
                                          else False))
            self.check(name, after, [self.get_transition(
                "reset_prefix_cache", after,
                request_id=("forced:" if forced else "") + str(bool(result)))])
        else:
            self.check(name, after)

    def after_schedule(self, out, mid: Observation) -> None:
        s = self.observer.scheduler
        preemptions = {rid: r.num_preemptions for rid, r in self.before_obs.requests.items()}
        step = self.observer.get_step_view(out, preemptions)
        self.scheduled |= set(out.num_scheduled_tokens)
        started = {rid: (step.num_computed_before[rid], s.requests[rid].num_tokens)
                   for rid in out.num_scheduled_tokens
                   if rid in step.num_computed_before and rid in s.requests}
        self.launched[id(out)] = Launched(out, step, started, {
            rid: mid.requests[rid].num_preemptions for rid in started if rid in mid.requests})
        self.tables = apply_scheduler_output(self.tables, step, mid.requests)
        t = self.get_transition("schedule", mid, step=step, worker_tables=self.tables)
        self.check("schedule", mid, [t], synced=False)

    def after_output(self, after: Observation) -> None:
        out = self.args[0]
        launched = self.launched.pop(id(out), None)
        if launched is not None and launched.out is not out:
            launched = None
        outcome = self.outcome  # mapped before the call
        history.process_output_applied(self.ghost, self.before_obs, after,
                                       outcome.finished_recving)
        t = self.get_transition("update_from_output", after,
                                step=launched.step if launched else None, outcome=outcome,
                                stale=self.get_stale(launched))
        self.check("update_from_output", after, [t], after_step=True)

    def get_stale(self, launched: Launched | None) -> frozenset:
        """Requests of a step preempted since it was scheduled."""
        if launched is None:
            return frozenset()
        now = self.before_obs.requests
        return frozenset(rid for rid, n in launched.preemptions.items()
                         if rid in now and now[rid].num_preemptions > n)

    def get_abort_transitions(self, after: Observation) -> list[Transition]:
        """``finish_requests`` with FINISHED_ABORTED, one abort per request
        (judged without the others it ended); another status is the caller's
        own ending (judged by the state claims only)."""
        status = self.args[1] if len(self.args) > 1 else None
        if getattr(status, "name", None) != RequestStatus.FINISHED_ABORTED.name:
            return []
        ids = self.get_finished_ids(self.args[0] if self.args else None)
        return [self.get_transition("abort", without(after, set(ids) - {rid}),
                                    before=without(self.before_obs, set(ids) - {rid}),
                                    request_id=rid) for rid in ids]

    # -- what a test does between calls ------------------------------------------------
    def get_pool(self) -> tuple:
        pool = self.observer._pool_view()
        return pool.ref_cnt, pool.free_queue

    def note_pool_changed_by_hand(self) -> None:
        """The block pool changed between two watched calls: the test took or
        freed blocks itself (no scheduler call did it)."""
        if self.pool_seen is not None and self.get_pool() != self.pool_seen:
            self.note_out_of_contract("the block pool changed between scheduler calls "
                                      "(blocks taken or freed by the test)")

    def note_mocked_methods(self) -> None:
        """The test replaced one of the scheduler's own methods (a connector,
        played by a mock, is the test's to play)."""
        s = self.observer.scheduler
        for name, value in vars(s).items():
            if isinstance(value, NonCallableMock) and callable(getattr(type(s), name, None)):
                self.note_out_of_contract(f"the scheduler's own {name} replaced by a mock")

    def check_mappable(self) -> None:
        """A KV cache manager swapped by the test, or requests in states
        kvspec does not model, end the watch."""
        if self.observer.scheduler.kv_cache_manager is not self.manager:
            raise Unmappable("the test replaced the scheduler's KV cache manager after "
                             "building it (kvspec mapped the first)")
        for r in self.observer.scheduler.requests.values():
            if r.status.name == "WAITING_FOR_STREAMING_REQ":
                raise Unmappable("a streaming session waiting for input "
                                 "(WAITING_FOR_STREAMING_REQ), which kvspec does not model")

    def note_hand_placed(self) -> None:
        s = self.observer.scheduler
        if any(r.request_id not in self.scheduled for r in s.running):
            self.note_out_of_contract("a request put into running without schedule()")


def wrap_method(obj, name: str, heard) -> None:
    """Have ``heard(args, result)`` hear every call of ``obj.name``: an
    instance attribute wrapping the bound method (once; never a mock's)."""
    method = getattr(obj, name, None)
    if not inspect.ismethod(method) or getattr(method, "_kvspec_heard", False):
        return

    @functools.wraps(method)
    def call(*args, **kwargs):
        result = method(*args, **kwargs)
        # a shape kvspec does not know: heard nothing (the answer stays unknown)
        with contextlib.suppress(Exception):
            heard(args, result)
        return result
    call._kvspec_heard = True
    setattr(obj, name, call)
