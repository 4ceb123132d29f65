"""The runner: drives a target one action at a time, plays the worker and the
outside world, and has every call judged. The Hypothesis state machine and
``kvspec replay`` both drive targets through it, so a trace replays exactly
what the fuzzer ran. Judging: ``judge.py``; the worker: ``model_runner.py``;
steps in flight: ``batch_queue.py``; the ghosts: ``spec/history.py``."""
from __future__ import annotations

import os
import site
import sysconfig
import time
import traceback
from collections import Counter

import attr
import attrs

import kvspec.spec
import kvspec.spec.catalogue  # noqa: F401  (registers every claim, in one order)
from kvspec.harness.batch_queue import BatchQueue, InFlight
from kvspec.harness.checker import ALL_KINDS, Checker, IncrementalGap
from kvspec.harness.drain import compute_drain_bound
from kvspec.harness.env import (ConnectorAnswerError, EnvConnector, EnvironmentContractViolation,
                                get_request_spec)
from kvspec.harness.features import (FEATURES, OUTSIDE_MODEL, count_async_schedule,
                                     count_delivery, count_step)
from kvspec.harness.hints import compute_hints, get_invalid_holders, get_tainted_blocks
from kvspec.harness.incremental import get_full_every
from kvspec.harness.judge import Judge
from kvspec.harness.kv_modes import KV_CLAIM, KV_MODES, KVWorkerError
from kvspec.harness.model_runner import ModelRunner
from kvspec.harness.steplog import (Counterexample, RunSnapshot, StepRecord, is_lost_performance,
                                    keep_first_lost, record_step)
from kvspec.harness.target import TargetStateError
from kvspec.harness.targets import TargetCannotMap, make_target
from kvspec.impl.connector import ConnectorContractError
from kvspec.spec import history
from kvspec.spec.actions import Transition
from kvspec.spec.conformance import ModelStep
from kvspec.spec.history import Ghost
from kvspec.spec.oracle import KVContent
from kvspec.spec.registry import Violation
from kvspec.spec.state import (Config, Observation, RequestStatus,
                               WorkerOutcome)

__all__ = ["ALL_KINDS", "FEATURES", "KV_CLAIM", "KV_MODES", "OUTSIDE_MODEL", "Counterexample",
           "KVWorkerError", "Runner", "is_lost_performance"]

ENVIRONMENT_CONTRACT = ("The environment answered outside the connector contract; "
                        "this is not a scheduler bug.")


#: an add's plan for the environment's own connector (``get_request_spec``)
PLAN_KEYS = frozenset({"ext", "async", "none", "send", "offload"})


def note_connector(v: Violation, env) -> Violation:
    """A request left waiting by its connector, not the scheduler: its latest
    lookup still answers "not known yet", or its connector took the worker's
    report of its finished load out and never passed it on: the message says so."""
    rid = v.message.split(" ", 1)[0]
    if rid in env.undecided:
        return attrs.evolve(v, message=v.message + "; its connector's latest lookup answered "
                            "'not known yet' (None), so the scheduler asks again each step")
    if rid in getattr(env, "held_back", ()):
        return attrs.evolve(v, message=v.message + "; its connector's update_connector_output "
                            "took the worker's report of its finished load out of "
                            "finished_recving and has not passed it on")
    return v


def describe_lookup(c) -> str:
    """A lookup's answer, as a log line shows it."""
    if c.malformed:
        return f"{c.request_id} -> {c.malformed}"
    if c.num_external is None:
        return f"{c.request_id} -> not known yet"
    return f"{c.request_id} -> {c.num_external}" + (" async" if c.is_async else "")


CONNECTOR_ANSWER = ("The connector answered outside the API's types, or its kvspec hook "
                    "(kvspec_stored_end) failed or answered out of range; kvspec stopped the "
                    "call before the scheduler used the answer.")


#: kvspec's model of the system (the oracle, the claims' helpers): an exception
#: raised in here is kvspec's own bug, never the target's
SPEC_DIR = os.path.realpath(kvspec.spec.__path__[0]) + os.sep


def _package_paths(name: str) -> list[str]:
    import importlib.util
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations or ()) if spec else []

HARNESS_DIR = os.path.dirname(os.path.realpath(__file__)) + os.sep
#: the folders of kvspec's packages (pyproject maps kvspec.spec to spec/ and so on)
KVSPEC_DIRS = tuple(os.path.realpath(p) + os.sep for m in (
    "kvspec", "kvspec.spec", "kvspec.impl", "kvspec.gpu") for p in _package_paths(m))
#: the harness's judging side: it observes and judges the target, never runs as
#: part of it (unlike the adapters, kvspec's connectors, its fixes and mutants)
JUDGING_MODULES = frozenset(HARNESS_DIR + f"{name}.py" for name in (
    "runner", "judge", "checker", "incremental", "frozen", "steplog", "hints", "features",
    "model_runner", "drain", "vllm_observe"))
#: code that raises on behalf of whoever called it (a frame of it decides
#: nothing): the standard library and attrs. Installed packages (vLLM, kvspec
#: itself) are not library code, though many Pythons keep them inside the
#: standard library's folder (``lib/python3.11/site-packages``).
STDLIB_DIR = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
INSTALLED_DIRS = tuple(os.path.realpath(p) + os.sep for p in {
    sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
    *site.getsitepackages(), site.getusersitepackages()})
ATTRS_DIRS = tuple(os.path.dirname(os.path.realpath(m.__file__)) + os.sep for m in (attr, attrs))


def is_library(path: str) -> bool:
    """A frame of the standard library or attrs, not of an installed package."""
    real = os.path.realpath(path)
    return real.startswith(ATTRS_DIRS) or (
        real.startswith(STDLIB_DIR) and not real.startswith(INSTALLED_DIRS))


KVSPEC_CRASHED = ("kvspec's own code (its model or the harness judging the target) raised "
                  "while judging the step, so the step is not judged: a bug in kvspec (where a "
                  "claim listed beside it names the target's fault, that fault is what kvspec "
                  "could not model). Please report it with this trace.")


def _frames(exc: BaseException) -> list:
    """The frames of ``exc`` and then of the exceptions it was explicitly
    raised from (``raise ... from``), leaving out library code (the standard
    library, attrs): the last is where the first of them raised (under a
    re-raise such as vLLM's located asserts, the line in vLLM, not the
    adapter's ``raise ... from``). What it was raised while handling (its
    implicit ``__context__``) is not followed: there the place is the handler's
    raise, and a counterexample Hypothesis was handling is kvspec's control
    flow, never a cause."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen and not is_control_flow(exc):
        seen.add(id(exc))
        chain += traceback.extract_tb(exc.__traceback__)
        exc = exc.__cause__
    return [f for f in chain if not f.filename.startswith("<") and not is_library(f.filename)]


def is_control_flow(exc: BaseException) -> bool:
    """kvspec's or Hypothesis's own exceptions for ending an example: what a
    crash was raised while handling, never its cause."""
    return isinstance(exc, Counterexample) or type(exc).__module__.startswith("hypothesis")


#: the contract claims that name a connector answer outside the API's types
#: (the ``connector_answer`` line that stopped the call says no more)
ANSWER_TYPE_CLAIMS = ("lookup_answer_has_the_api_types", "finish_answer_has_the_api_types",
                      "meta_is_connector_metadata")


def describe_crash(exc: Exception) -> Violation:
    """A call that raised: the target's crash (a finding), or kvspec's own when
    the exception was raised inside its model (``spec/``), where a target's
    odd state must be judged, never crash the judge, or inside the harness's
    judging side with none of the target's code (vLLM, the reference, kvspec's
    adapters, connectors, fixes and mutants) on the way. A ``TargetStateError``
    is the target's: the observer names a state the target must never reach."""
    frames = _frames(exc)
    last = frames[-1] if frames else None
    print_once_if_debugging(exc)
    paths = [os.path.realpath(f.filename) for f in frames]
    ours = last is not None and not isinstance(exc, TargetStateError) and (
        paths[-1].startswith(SPEC_DIR)
        or all(p in JUDGING_MODULES or p.startswith(SPEC_DIR) for p in paths))
    if ours:
        top = os.path.dirname(SPEC_DIR[:-1])
        where = f"{os.path.relpath(last.filename, top)}:{last.lineno}"
        return Violation("kvspec_crashed", f"{type(exc).__name__} at {where}: {exc}",
                         KVSPEC_CRASHED)
    where = f", at {get_where(frames)}" if last is not None else ""
    opening = "The connector's own code raised" if is_connectors_crash(frames) else LEGAL_CALL
    return Violation("target_crashed", f"{type(exc).__name__}: {exc}", f"{opening}{where}.")


#: crashes whose traceback ``KVSPEC_DEBUG`` printed (shrinking meets one many times)
_PRINTED: set[tuple[str, str]] = set()


def print_once_if_debugging(exc: BaseException) -> None:
    """With ``KVSPEC_DEBUG`` set, a crash's whole traceback, once per kind and
    message in a process."""
    key = (type(exc).__name__, str(exc))
    if os.environ.get("KVSPEC_DEBUG") and key not in _PRINTED:
        _PRINTED.add(key)
        traceback.print_exception(exc)


#: how a target crash's doc begins when nothing was wrong with what it was given
LEGAL_CALL = "The target raised while handling a legal call"


def reword_crash(crash: Violation, opening: str) -> Violation:
    """A target crash whose doc opens with ``opening`` in place of
    ``LEGAL_CALL``, keeping where it raised."""
    return attrs.evolve(crash, doc=opening + crash.doc.removeprefix(LEGAL_CALL))


def describe_crash_after_breach(crash: Violation, breaches: list[Violation]) -> Violation:
    """A crash in the action whose connector answers broke the contract: the
    breach (listed first) is the cause, the crash what vLLM did with it."""
    names = ", ".join(dict.fromkeys(v.invariant for v in breaches))
    return reword_crash(crash, f"The target raised after the connector broke its contract "
                               f"({names}, above)")


def is_connectors_crash(frames: list) -> bool:
    """The innermost frame of vLLM, kvspec or code outside the installed
    packages is none of vLLM's or kvspec's: an out-of-tree connector's own
    code raised. An installed package's frame (torch, numpy, a connector's
    own package) decides nothing: vLLM calls those too, so such a crash
    keeps the target's wording."""
    owners = [f for f in frames if not is_other_package(f.filename)]
    return bool(owners) and not is_vllms_or_kvspecs(owners[-1].filename)


def is_vllms_or_kvspecs(path: str) -> bool:
    """A file of vLLM or of one of kvspec's packages (``spec/``, ``impl/`` and
    ``gpu/`` live beside ``kvspec/``)."""
    return is_vllms(path) or os.path.realpath(path).startswith(KVSPEC_DIRS)


def is_vllms(path: str) -> bool:
    """A file of vLLM's package (patched modules keep its path in their name)."""
    return "/vllm/" in path.replace(os.sep, "/")


def is_other_package(path: str) -> bool:
    """An installed package's file, neither vLLM's nor kvspec's."""
    return os.path.realpath(path).startswith(INSTALLED_DIRS) and not is_vllms_or_kvspecs(path)


#: the opening of a crash's doc after answers the in-tree connectors never give
BEYOND_CONTRACT_CRASH = ("The target raised after a connector answer outside the in-tree "
                         "connectors' contract ({ids} marked beyond_contract, stepping outside "
                         "it on purpose)")


def describe_crash_beyond_contract(crash: Violation, request_ids: list[str]) -> Violation:
    """A crash in a run whose connector answered as no in-tree connector does
    (a finding replayed that way): its call was not a legal one, so say so."""
    ids = (f"{request_ids[0]} is an arrival" if len(request_ids) == 1
           else f"{', '.join(request_ids)} are arrivals")
    return reword_crash(crash, BEYOND_CONTRACT_CRASH.format(ids=ids))


def get_where(frames: list) -> str:
    """Where a crash raised, and the call that led there when that came from
    another file (a connector's method called by vLLM's scheduler)."""
    last = frames[-1]
    # kvspec's adapter calling the target, or its probe wrapping a connector
    # method, says nothing: the caller shown is the target's own
    callers = [f for f in frames[:-1] if f.filename != last.filename
               and not os.path.realpath(f.filename).startswith(HARNESS_DIR)]
    if not is_vllms(last.filename):  # vLLM's call into it, if any
        callers = [f for f in callers if is_vllms(f.filename)] or callers
    if not callers:
        return get_place(last)
    return f"{get_place(last)}, called from {get_place(callers[-1])}"


def get_place(frame) -> str:
    """``vllm/.../file.py:LINE in function`` of a frame (the source's line where
    kvspec patched the module): shown under a crash whose message names no
    place (a TypeError deep in vLLM), never in the message, which recorded
    verdicts compare."""
    from kvspec.harness.vllm_patches import get_shown_place
    short, lineno = get_shown_place(frame.filename, frame.lineno)
    if os.path.isabs(short):  # not vLLM's: the reference's, a connector's
        short = os.path.relpath(short)
    return f"{short}:{lineno} in {frame.name}"


class BudgetSpent(Exception):
    """The campaign's time ran out inside a drain (a production-sized healed
    phase may step thousands of times): the run ends without a verdict."""


class Runner:
    #: ``time.monotonic()`` past which a drain stops (``BudgetSpent``); None: never
    deadline: float | None = None

    def __init__(self, target_name: str, config: Config, kinds=ALL_KINDS,
                 design_rules: bool = True, ignore=frozenset(), kv: str = "symbolic",
                 full_every: int | None = None) -> None:
        self.target_name, self.config, self.kv = target_name, config, kv
        #: state and data claims judge only what each call changed, and
        #: everything every ``full_every`` checks (None: ``get_full_every``)
        #: and at the end (``finish``)
        self.checker = Checker(kinds, design_rules, ignore,
                               get_full_every() if full_every is None else full_every)
        self.checks, self.witnessed = self.checker.checks, self.checker.witnessed
        self.content = KVContent(config.num_blocks, config.block_size, config.groups)
        self.env = EnvConnector(self.content, self._observe_request)
        #: how many of the connector calls not yet judged a row already shows
        #: (the drain's steps show their own lookups; the drain's row the rest)
        self._calls_shown = 0
        self.target = make_target(target_name, config, self.env)
        #: a real connector's world (None: kvspec's own connector answers), and
        #: whether the log leaves out the add plan nothing then reads
        self.world = getattr(self.target, "world", None)
        self.hides_plan = False
        if self.world is not None:  # (the worlds' module only for a real connector)
            from kvspec.harness.connector_worlds import is_generic_world
            self.hides_plan = is_generic_world(self.world)
        self.ghost, self.features = Ghost(), Counter()
        self.judge = Judge(self.checker, self.ghost, self.content, self.target, self.features)
        self.model_runner = ModelRunner(config, self.content, self.env, kv, self.ghost,
                                        self.features)
        #: synchronous scheduling is a batch queue of depth 1
        self.is_sync = not config.async_scheduling
        self.queue = BatchQueue(config.num_steps_in_flight, self.ghost)
        self.actions: list[dict] = []
        self.log: list[StepRecord] = []
        self.violation_counts: Counter = Counter()
        #: efficiency claims broken (lost performance): the run goes on; the
        #: first break of each set of claims, with the trace up to it
        self.lost: list[Counterexample] = []
        self.obs: Observation = self.target.observe()

    def _observe_request(self, request_id: str):  # a method: a deepcopy (bmc) copies it
        return self.target.observe_request(request_id)

    @property
    def worker(self):
        """The torch worker, or None (the data oracle alone)."""
        return self.model_runner.kv

    def apply(self, action: dict) -> None:
        """The one entry point: an action, judged; a broken safety or design
        claim raises its ``Counterexample``, lost performance is kept."""
        self.actions.append(action)
        try:
            violations = (getattr(self, "_do_" + action["op"])(action)
                          + self.model_runner.take_violations(self.target))
        except (ConnectorContractError, EnvironmentContractViolation) as exc:
            violations = [Violation("environment_contract", str(exc), ENVIRONMENT_CONTRACT)]
        except ConnectorAnswerError as exc:  # recorded: the contract names it (check_calls)
            violations = [Violation("connector_answer", str(exc), CONNECTOR_ANSWER)]
        except (Counterexample, TargetCannotMap, KVWorkerError, IncrementalGap, BudgetSpent):
            raise
        except Exception as exc:  # the target crashed: a finding, not a harness error
            violations = [describe_crash(exc)]
        # the connector's answers first: a breach of its contract is the cause
        # of whatever the scheduler then did with them (a crash included)
        calls = self.env.take_calls()
        shown_calls, self._calls_shown = calls[self._calls_shown:], 0
        breaches = self.checker.check_calls(calls)
        violations = breaches + [self._get_crash_doc(v, breaches) for v in violations]
        if any(v.invariant in ANSWER_TYPE_CLAIMS for v in violations):
            violations = [v for v in violations if v.invariant != "connector_answer"]
        violations = list({(v.invariant, v.message): v for v in violations}.values())
        record_step(self.log, self.violation_counts, self._get_shown(action, shown_calls),
                    self.obs, violations)
        lost = [v for v in violations if is_lost_performance(v)]
        if lost:
            keep_first_lost(self.lost, lost, lambda: RunSnapshot(
                self.config, list(self.actions), list(self.log), self.kv))
        if len(lost) < len(violations):  # only safety and design claims stop a run
            raise Counterexample([v for v in violations if v not in lost], self)

    def _get_crash_doc(self, violation: Violation, breaches: list[Violation]) -> Violation:
        """A target crash after answers outside the connector contract (a
        breach judged in the same action, or arrivals marked
        ``beyond_contract``) does not call its call legal."""
        if violation.invariant != "target_crashed" or not violation.doc.startswith(LEGAL_CALL):
            return violation
        if breaches:
            return describe_crash_after_breach(violation, breaches)
        answered = getattr(self.env, "answers", {})  # looked up: answered outside it
        beyond = [rid for rid, plan in getattr(self.env, "plans", {}).items()
                  if plan.beyond_contract and rid in answered]
        return describe_crash_beyond_contract(violation, beyond) if beyond else violation

    def _take_unshown_calls(self) -> list:
        """The connector calls since the last row that showed its own (they
        stay the env's until the action ends, which judges them all)."""
        calls, self._calls_shown = self.env.calls[self._calls_shown:], len(self.env.calls)
        return calls

    def _get_shown(self, action: dict, calls) -> dict:
        """The action as its log line shows it. With a real connector: the
        answers its lookups gave (the connector's own, not the environment's
        plan), and for one kvspec plays no world around, without the plan,
        which nothing then reads."""
        if self.world is None:
            return action
        shown = {k: v for k, v in action.items() if not (self.hides_plan and k in PLAN_KEYS)}
        answers = [describe_lookup(c) for c in calls if c.op == "lookup"]
        if answers:
            shown["lookups"] = "; ".join(answers)
        return shown

    def run(self, actions) -> Counterexample | None:
        """Apply ``actions`` in order until one breaks a claim; that
        counterexample, or None if every claim held."""
        try:
            for action in actions:
                self.apply(action)
            self.finish()
        except Counterexample as exc:
            return exc
        return None

    def finish(self) -> None:
        """The end of a run: the last state judged whole (``Checker.check_full``);
        a violation an incremental check missed is the last action's."""
        found = self.checker.check_full()
        if found:
            if self.log:  # the last action's line says what it broke
                last = self.log[-1]
                self.log[-1] = attrs.evolve(last, violations=last.violations + tuple(found))
            self.violation_counts.update(v.invariant for v in found)
            lost = [v for v in found if is_lost_performance(v)]
            if len(lost) < len(found):
                raise Counterexample([v for v in found if v not in lost], self)

    def _settle(self, t: Transition, lowered_ok=frozenset(),
                model_step: ModelStep | None = None) -> list[Violation]:
        self.obs = t.after
        return self.judge.settle(t.after, t, self.env.answers, lowered_ok, model_step)

    def _judged(self, t: Transition) -> list[Violation]:
        """A call that is one model step with no hints: add, abort, reset."""
        return self._settle(t, model_step=self.judge.get_model_step(t))

    # -- actions --------------------------------------------------------------
    def _do_add(self, a: dict) -> list[Violation]:
        spec = get_request_spec(a)
        self.env.plan(spec)
        before = self.obs
        self.target.add_request(spec)
        return self._judged(self.judge.get_transition("add", before, self.target.observe(),
                                                      request_id=spec.request_id))

    def _do_step(self, a: dict) -> list[Violation]:
        """One ``EngineCore.step_with_batch_queue`` call: schedule a step and
        launch it (the worker runs it at once: its KV lands in stream order);
        once the queue is full, or nothing was scheduled and nothing is left
        to schedule, apply the oldest step's output. (Synchronous, the queue is
        1 deep, and the harness schedules even when the scheduler is empty.)"""
        violations: list[Violation] = []
        if self.obs.requests or self.is_sync:
            job, violations = self._launch(a)
            more = job is not None and (job.step.total_num_scheduled_tokens > 0
                                        or bool(self.obs.requests))
            if job is None or (len(self.queue) < self.queue.depth and more):
                return violations
        if not len(self.queue):
            return violations
        return violations + self._deliver_oldest(a)

    def _launch(self, a: dict) -> tuple[InFlight | None, list[Violation]]:
        """``schedule()``, judged; the worker runs the step: it joins the queue."""
        job, found = self._schedule()
        if found and not self.is_sync:  # the worker cannot run a broken step
            return None, found
        pending = self.queue.get_pending_tokens()
        work = self.queue.get_worker_view(job.step, a, job.before, pending)
        self.features["draft_rollback_in_flight"] += (work.num_computed_before
                                                      != job.step.num_computed_before)
        job.report = self.model_runner.execute(work, job.mid, a, pending)
        history.process_loads_finished(self.ghost, job.report.loaded_ok)
        job.sampled = self.model_runner.sample(work, job.mid, a, pending)
        self.queue.push(job)
        if self.is_sync:  # its output is back at once: judged with it
            return job, found
        # the state again, synced (the real boundary), with the data the step wrote
        found = self.judge.check(job.mid, kinds=("state", "data"))
        self.content.forget_completed()  # judged once, right after the step
        return job, found

    def _schedule(self) -> tuple[InFlight, list[Violation]]:
        """One ``schedule()``; the worker reads its output. Async, the model
        judges it alone; synchronous, with its output (``get_delivery_step``)."""
        before = self.obs
        answers_before, asked = dict(self.env.answers), len(self.env.answer_log)
        self.content.note_step_start(before)
        step = self.target.schedule()
        if not self.config.kv_connector:
            self.env.note_local_hits(step)
        mid = self.target.observe()
        self.content.learn(mid)
        history.process_observation(self.ghost, mid, self.env.answers, frozenset())
        count_async_schedule(self.features, step, self.queue.get_in_flight_ids(),
                             len(self.queue))
        job = InFlight(step, before, mid, None, {}, shares=self.queue.process_scheduled(step, mid),
                       answers_before=answers_before, asked=self.env.answer_log[asked:])
        self.model_runner.tell(step, mid)
        t = self.judge.get_transition("schedule", before, mid, step=step,
                                      worker_tables=self.model_runner.tables)
        model_step = None if self.is_sync else self.judge.get_model_step(t, compute_hints(
            before, mid, mid.requests, step, WorkerOutcome({}), answers_before, job.asked))
        found = self.judge.check(mid, kinds=("state",), transition=t, model_step=model_step)
        self.judge.advance_book(model_step)
        if not self.is_sync:  # (synchronous, one call: a crash logs the state before it)
            self.obs = mid
        return job, found

    def _deliver_oldest(self, a: dict) -> list[Violation]:
        """The oldest step's output is back: its writes have all landed, then
        ``update_from_output`` applies it."""
        job = self.queue.pop_oldest()
        before = job.mid if self.is_sync else self.obs
        self.content.complete(job.report.step_id)
        outcome = self.model_runner.get_outcome(job.report, job.sampled, a, before)
        self.target.update_from_output(outcome)
        if self.is_sync:  # the drafter proposes for the next step
            self.target.update_draft_token_ids(
                self.model_runner.get_drafts(self.target.observe, a.get("drafts", 0)))
        after = self.target.observe()
        self.queue.process_delivered(job, before, after)
        # one preempted since the step ran (its output is stale) recomputes anyway
        readers = {rid: pos for rid, pos in job.report.garbage_readers.items()
                   if rid not in job.stale}
        t = self.judge.get_transition("update_from_output", before, after, step=job.step,
                                      outcome=outcome, garbage_readers=readers,
                                      stale=frozenset(job.stale))
        self.model_runner.note_output_applied(before, after, job.report, outcome)
        count_step(self.features, self.config, job.step, outcome, job.mid)
        count_delivery(self.features, job.stale, outcome, self.env.plans, before, after)
        history.process_departed(self.ghost, after)
        # who computed on this step's failed KV: it, and the steps still in flight after it
        tainted = get_tainted_blocks(before, job.report, job.mid,
                                     [j.step for j in (job, *self.queue.jobs)])
        found = self._settle(t, get_invalid_holders(before, tainted),
                             self.judge.get_delivery_step(job, t, outcome, self.is_sync, tainted,
                                                           self.queue.jobs))
        if self.is_sync:
            self.content.forget_completed()  # judged once, right after the step
        return found

    def _do_abort(self, a: dict) -> list[Violation]:
        before = self.obs
        history.process_abort(self.ghost, before.requests.get(a["id"]))
        self.target.abort(a["id"])
        return self._judged(self.judge.get_transition("abort", before, self.target.observe(),
                                                      request_id=a["id"]))

    def _do_reset_prefix_cache(self, a: dict) -> list[Violation]:
        before, forced = self.obs, bool(a.get("running"))
        if forced and self.model_runner.is_kv_in_transfer(self.obs):
            # vLLM raises then, saying it does not support it: not a call the
            # environment makes (the machine never asks for one)
            raise EnvironmentContractViolation(
                "a forced reset_prefix_cache while KV is in transfer (vLLM does not support it)")
        ok = self.target.reset_prefix_cache(forced)
        self.features["prefix_cache_resets"] += bool(ok)
        after = self.target.observe()
        preempted = {rid for rid in before.running if rid in after.requests
                     and after.requests[rid].status != RequestStatus.RUNNING}
        self.features["output_in_flight_at_preemption"] += bool(
            preempted & self.queue.get_in_flight_ids())
        self.queue.drop_output(preempted)
        return self._judged(self.judge.get_transition(
            "reset_prefix_cache", before, after,
            request_id=("forced:" if forced else "") + str(bool(ok))))

    def _has_push_work(self) -> bool:
        """A real connector still has transfers to report (vLLM's engine keeps
        stepping while ``has_pending_push_work``, scheduler.py ``has_requests``)."""
        pending = getattr(self.target, "has_pending_push_work", None)
        return bool(pending and pending())

    def _do_drain(self, a: dict) -> list[Violation]:
        """The healed phase: no faults, every load and send completes."""
        bound = compute_drain_bound(self.config, [(len(r.prompt_token_ids), r.max_tokens)
                                                  for r in self.obs.requests.values()],
                                    self.config.num_steps_in_flight)
        history.process_drain(self.ghost, self.obs)
        for _ in range(bound):
            if not self.obs.requests and not len(self.queue) and not self._has_push_work():
                break
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise BudgetSpent()
            healed = {"op": "step", "finish_loads": self.content.pending_async_loads(),
                      "finish_sends": list(self.content.sends)}
            violations = self._do_step(healed) + self.model_runner.take_violations(self.target)
            if violations:
                return violations
            record_step(self.log, self.violation_counts,
                        self._get_shown({"op": "drain.step"}, self._take_unshown_calls()),
                        self.obs, ())
        return self.checker.check_full() + [note_connector(v, self.env)
                                             for v in self.judge.check_liveness(self.obs)]
