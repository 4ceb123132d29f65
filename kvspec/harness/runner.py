"""The runner: applies one action to a target, plays the worker, and checks the
spec's relation, every invariant and the data oracle after every call.

The Hypothesis state machine and ``kvspec replay`` both drive targets through
this class, so a trace replays exactly what the fuzzer ran.
"""
from __future__ import annotations

from collections import Counter

import attrs

import kvspec.spec.catalogue  # noqa: F401  (registers every claim, in one order)
from kvspec.harness.env import (EOS_TOKEN_ID, EnvConnector, EnvironmentContractViolation,
                                RequestSpec, draft_token, sampled_token)
from kvspec.harness.targets import TargetCannotMap, make_target
from kvspec.impl.connector import ConnectorContractError
from kvspec.spec.actions import Transition
from kvspec.spec.arith import compute_num_rejected
from kvspec.spec.conformance import (Hints, ModelBook, ModelStep, compute_admission,
                                    get_num_blocks)
from kvspec.spec.groups import NULL_BLOCK, compute_tainted_blocks
from kvspec.spec import history
from kvspec.spec.history import Ghost
from kvspec.spec.invariants import Context
from kvspec.spec.worker import apply_scheduler_output
from kvspec.spec.oracle import KVContent
from kvspec.spec.registry import REGISTRY, Violation, evaluate
from kvspec.spec.state import (BATCH_QUEUE_DEPTH, Config, Observation, RequestStatus, StepView,
                               WorkerOutcome)


def make_kv_worker(kv: str, config: Config, content: KVContent, plans: dict):
    """The worker's KV in real tensors (``kv="torch"``), or None: the data
    oracle alone. torch is imported only for "torch"."""
    if kv not in KV_MODES:
        raise ValueError(f"unknown KV mode {kv!r}: use {' or '.join(KV_MODES)}")
    if kv == "symbolic":
        return None
    from kvspec.harness.torch_worker import TorchWorker
    return TorchWorker(config, content, plans)


class KVWorkerError(Exception):
    """The torch worker and the data oracle disagree about the environment:
    a harness bug, never a finding of the target."""


class Counterexample(Exception):
    def __init__(self, violations: list[Violation], runner: "Runner") -> None:
        super().__init__("; ".join(map(str, violations)))
        self.violations = violations
        self.runner = runner


@attrs.frozen
class RunSnapshot:
    """A run as it stood at one action: what a trace is saved from."""

    config: Config
    actions: list
    log: list
    kv: str


def is_lost_performance(v: Violation) -> bool:
    """A claim of role "efficiency": work lost, nothing corrupted."""
    inv = REGISTRY.get(v.invariant)
    return inv is not None and inv.role == "efficiency"


@attrs.frozen
class StepRecord:
    index: int
    action: str
    requests: str
    violations: tuple[Violation, ...] = ()


def describe_request(r) -> str:
    stats = f" hit={r.num_cached_tokens}/{r.num_external_computed_tokens}" if r.has_stats else ""
    blocks = ",".join(map(str, r.block_ids[0])) if r.block_ids else ""
    pre = f" pre={r.num_preemptions}" if r.num_preemptions else ""
    held = f" ph={r.num_output_placeholders}" if r.num_output_placeholders else ""
    return (f"{r.request_id}:{r.status.name[:12]} c={r.num_computed_tokens}/{r.num_tokens}"
            f"{held}{stats}{pre} b=[{blocks}]")


def describe_action(action: dict) -> str:
    args = [f"{k}={v}" for k, v in action.items() if k != "op" and v not in ((), [], 0, False, None)]
    return f"{action['op']}({', '.join(args)})"


ALL_KINDS = ("state", "data", "relation", "model", "liveness")

#: actions that ended without a conformance step (``check --json``'s not_evaluated)
OUTSIDE_MODEL = "actions_outside_conformance_model"

#: environment features a run exercises, counted in steps (``kvspec check --json``)
FEATURES = ("load_failures", "async_loads", "preemptions", "spec_decode",
            "failure_policy_recompute", "failure_policy_fail", "policy_fcfs", "policy_priority",
            "sends", "prefix_cache_resets", "async_scheduling",
            "output_in_flight_at_preemption", "draft_rollback_in_flight",
            # several KV cache groups (issue 11)
            "hybrid_groups", "sliding_window", "last_state_group",
            "load_failure_in_non_full_group",
            # steps whose KV was moved and checked in real tensors (--kv torch, issue 13)
            "kv_torch")

#: the claim the torch worker reports under (kvspec/harness/torch_worker.py)
KV_CLAIM = "kv_tensors_match_oracle"

#: how the worker's KV is modelled: "symbolic" (the data oracle alone) or
#: "torch" (real tensors beside it: kvspec/harness/torch_worker.py)
KV_MODES = ("symbolic", "torch")


@attrs.define
class InFlight:
    """A step scheduled and executed whose output the scheduler has not seen
    (async scheduling: ``EngineCore.step_with_batch_queue``'s batch queue)."""

    step: StepView
    #: the state right after it was scheduled
    mid: Observation
    report: object  # kvspec.spec.oracle.ExecReport
    sampled: dict[str, tuple[int, ...]]
    #: requests preempted after this step was scheduled: their output is stale
    stale: set[str] = attrs.Factory(set)
    #: per request that samples in this step, the tokens it will sample if every
    #: draft is accepted (1 + drafts): the placeholders it owns until delivered
    shares: dict[str, int] = attrs.Factory(dict)


def _tainted_blocks(obs: Observation, report) -> set[int]:
    """Blocks the step's failed loads left invalid; with several kinds of group
    the blocks a reader of invalid KV wrote its garbage into, and everything the
    spec counts as failed with them (``compute_tainted_blocks``: a request can
    read another group's block computed on top of a failed one without holding
    the failed block). Not a holder's blocks before its first failed one: the
    hits it only read stay valid for every other holder."""
    bad = set(report.invalid_block_ids)
    if bad and obs.config.is_hybrid:
        holders = [(r.block_ids, r.num_computed_tokens - r.num_output_placeholders)
                   for r in obs.requests.values()]
        bad = compute_tainted_blocks(holders, obs.config.block_size,
                                     bad | report.garbage_blocks)
    return bad


def _invalid_holders(obs: Observation, report) -> set[str]:
    """Requests holding a tainted block (``_tainted_blocks``)."""
    bad = _tainted_blocks(obs, report)
    return {r.request_id for r in obs.requests.values()
            if bad & {b for table in r.block_ids for b in table}}


def _num_rejected(job: InFlight, rid: str) -> int:
    """Drafts of the request that this step's output rejects (0 if it samples nothing)."""
    drafts = len(job.step.scheduled_spec_decode_tokens.get(rid, ()))
    if not drafts or rid not in job.sampled:
        return 0
    return compute_num_rejected(drafts, len(job.sampled[rid]))


def _was_cut(rid: str, job: InFlight, before: Observation, after: Observation) -> bool:
    """Its computed count fell at this delivery by more than its rejected drafts."""
    was, now = before.requests.get(rid), after.requests.get(rid)
    if was is None or now is None:
        return False
    return now.num_computed_tokens < was.num_computed_tokens - _num_rejected(job, rid)


class Runner:
    def __init__(self, target_name: str, config: Config, kinds=ALL_KINDS,
                 design_rules: bool = True, ignore=frozenset(), kv: str = "symbolic") -> None:
        #: which kinds of claims are checked ("data" alone: the data oracle only)
        self.kinds = tuple(kinds)
        #: claims not checked, to see what a known violation leads to (replay --ignore)
        self.ignore = frozenset(ignore)
        #: whether claims of role "design" (vLLM's design rules) are checked too
        self.design_rules = design_rules
        self.target_name = target_name
        self.config = config
        self.content = KVContent(config.num_blocks, config.block_size, config.groups)
        self.env = EnvConnector(self.content, self._observe_request)
        self.target = make_target(target_name, config, self.env)
        self.kv = kv
        self.worker = make_kv_worker(kv, config, self.content, self.env.plans)
        self.ghost = Ghost()
        self.book = ModelBook()
        #: the block tables the worker built from the scheduler outputs (spec/worker.py)
        self.worker_tables: dict = {}
        self.actions: list[dict] = []
        self.log: list[StepRecord] = []
        self.checks: Counter = Counter()
        self.witnessed: Counter = Counter()
        self.features: Counter = Counter()
        self.violation_counts: Counter = Counter()
        #: efficiency claims broken (lost performance): the run goes on; the
        #: first break of each set of claims, with the trace up to it
        self.lost: list[Counterexample] = []
        #: async scheduling: steps in flight, oldest first
        self.in_flight: list[InFlight] = []
        self.obs: Observation = self.target.observe()

    def _observe_request(self, request_id: str):
        return self.target.observe_request(request_id)

    # -- the one entry point --------------------------------------------------
    def apply(self, action: dict) -> None:
        self.actions.append(action)
        try:
            violations = getattr(self, "_do_" + action["op"])(action) + self._kv_violations()
        except (ConnectorContractError, EnvironmentContractViolation) as exc:
            violations = [Violation("environment_contract", str(exc),
                                    "The environment answered outside the connector contract; "
                                    "this is not a scheduler bug.")]
        except (Counterexample, TargetCannotMap, KVWorkerError):
            raise
        except Exception as exc:  # the target crashed: a finding, not a harness error
            violations = [Violation("target_crashed", f"{type(exc).__name__}: {exc}",
                                    "The target raised while handling a legal call.")]
        violations = list({(v.invariant, v.message): v for v in violations}.values())
        self._record(action, violations)
        lost = [v for v in violations if is_lost_performance(v)]
        stopping = [v for v in violations if v not in lost]
        if lost:
            self._note_lost(lost)
        if stopping:  # only safety and design claims stop a run
            raise Counterexample(stopping, self)

    def _note_lost(self, lost: list[Violation]) -> None:
        """Keep the first break of these efficiency claims, with the trace so far."""
        claims = {v.invariant for v in lost}
        if all({v.invariant for v in known.violations} != claims for known in self.lost):
            snapshot = RunSnapshot(self.config, list(self.actions), list(self.log), self.kv)
            self.lost.append(Counterexample(lost, snapshot))

    def run(self, actions) -> Counterexample | None:
        """Apply ``actions`` in order until one breaks a claim; that
        counterexample, or None if every claim held."""
        try:
            for action in actions:
                self.apply(action)
        except Counterexample as exc:
            return exc
        return None

    def _record(self, action: dict, violations) -> None:
        requests = " ".join(describe_request(r) for r in self.obs.requests.values())
        self.log.append(StepRecord(len(self.log), describe_action(action), requests,
                                   tuple(violations)))
        for v in violations:
            self.violation_counts[v.invariant] += 1

    # -- checking -------------------------------------------------------------
    def is_checked(self, inv) -> bool:
        return (inv.kind in self.kinds and (inv.role != "design" or self.design_rules)
                and inv.name not in self.ignore)

    def _check(self, obs: Observation, kinds=("state", "data"), transition=None,
               model_step: ModelStep | None = None) -> list[Violation]:
        after_step = transition is not None and transition.action == "update_from_output"
        ctx = Context(obs, self.ghost, self.content, synced="data" in kinds, after_step=after_step)
        found = []
        for inv in REGISTRY.values():
            if not self.is_checked(inv):
                continue
            if inv.kind == "relation":
                if transition is None or not inv.applies_to(transition.action):
                    continue
                subject = transition
            elif inv.kind == "model":
                if model_step is None:
                    continue
                subject = model_step
            elif inv.kind in kinds:
                subject = ctx
            else:
                continue
            messages, witnessed = evaluate(inv, subject)
            self.checks[inv.name] += 1
            self.witnessed[inv.name] += witnessed
            found += [Violation(inv.name, m, inv.doc) for m in messages]
        return found

    def _settle(self, after: Observation, transition: Transition, lowered_ok=frozenset(),
                model_step: ModelStep | None = None):
        self.content.learn(after)
        self._update_ghost(after, lowered_ok)
        self.obs = after
        self.features[OUTSIDE_MODEL] += model_step is None  # none do: check --json says so
        found = self._check(after, transition=transition, model_step=model_step)
        self._advance_book(model_step)
        return found

    def _advance_book(self, model_step: ModelStep | None) -> None:
        """The model's ghost moves on past a judged action."""
        if model_step is not None and model_step.admission is not None:
            self.book = model_step.admission.get_book()

    def _update_ghost(self, obs: Observation, lowered_ok) -> None:
        history.process_observation(self.ghost, obs, self.env.answers, lowered_ok)

    def _tell_worker(self, step: StepView, mid: Observation) -> None:
        """The worker reads the scheduler output: its block tables move on."""
        self.worker_tables = apply_scheduler_output(self.worker_tables, step, mid.requests)

    def _departed(self, before: Observation, after: Observation) -> dict:
        """Requests that left the scheduler during an action, as they ended."""
        gone = {}
        for rid in before.requests:
            if rid not in after.requests:
                view = self.target.final_view(rid)
                if view is not None:
                    gone[rid] = view
        return gone

    def _transition(self, action: str, before: Observation, after: Observation,
                    departed=None, **kwargs) -> Transition:
        departed = self._departed(before, after) if departed is None else departed
        return Transition(action, before, after, departed=departed,
                          first_hits=dict(self.ghost.first_hits),
                          recovered=frozenset(self.ghost.recovered), **kwargs)

    def _model_step(self, transition: Transition, hints=None) -> ModelStep:
        """The conformance claim's view of an action (from the state before it)."""
        t = transition
        step = ModelStep(t.action, t.before, t.after, hints or {}, self.book, t.request_id,
                         departed=t.departed)
        if self.is_checked(REGISTRY["transition_admitted_by_model"]):
            step.admission = compute_admission(step)
        return step

    # -- actions --------------------------------------------------------------
    def _do_add(self, a: dict) -> list[Violation]:
        spec = RequestSpec(a["id"], tuple(a["prompt"]), a["max_tokens"], a.get("priority", 0),
                           a.get("ext", 0), a.get("async", False), a.get("none", 0),
                           a.get("send", False), a.get("offload", False),
                           # an overclaim is outside the contract by definition
                           a.get("beyond_contract", False) or a.get("overclaim_ok", False))
        if spec.ext > len(spec.prompt) and not a.get("overclaim_ok"):
            raise EnvironmentContractViolation(
                f"the store cannot hold {spec.ext} tokens of a {len(spec.prompt)}-token prompt")
        self.env.plan(spec)
        before = self.obs
        self.target.add_request(spec)
        after = self.target.observe()
        t = self._transition("add", before, after, request_id=spec.request_id)
        return self._settle(after, t, model_step=self._model_step(t))

    def _do_step(self, a: dict) -> list[Violation]:
        if self.config.async_scheduling:
            return self._do_async_step(a)
        before, step, mid, answers_before, asked = self._schedule()
        self._tell_worker(step, mid)
        t = self._transition("schedule", before, mid, step=step,
                             worker_tables=self.worker_tables)
        violations = self._check(mid, kinds=("state",), transition=t)
        report = self._execute(step, mid, a)
        self.content.complete(report.step_id)  # synchronous: its output is back at once
        history.process_loads_finished(self.ghost, report.loaded_ok)
        outcome = self._outcome(report, self._sample(step, mid, a), a, mid)
        self.target.update_from_output(outcome)
        self.target.update_draft_token_ids(self._drafts(a.get("drafts", 0)))
        after = self.target.observe()
        holders = _invalid_holders(mid, report)
        departed = self._departed(before, after)
        t = self._transition("update_from_output", mid, after, departed, step=step,
                             outcome=outcome, garbage_readers=report.garbage_readers)
        self._note_output_applied(mid, after, report, outcome)
        self._count_features(step, outcome, mid)
        hints = self._hints(before, mid, after.requests | departed, step, outcome,
                            answers_before, self.env.answer_log[asked:],
                            _tainted_blocks(mid, report))
        whole_step = self._transition("step", before, after, departed)
        violations += self._settle(after, t, lowered_ok=holders,
                                   model_step=self._model_step(whole_step, hints))
        self.content.forget_completed()  # judged once, right after the step
        return violations

    def _schedule(self):
        """One ``schedule()``: the state before and after it, the step, and the
        connector's answers before it with where this call's answers start."""
        before = self.obs
        answers_before, asked = dict(self.env.answers), len(self.env.answer_log)
        self.content.note_step_start(before)
        step = self.target.schedule()
        mid = self.target.observe()
        self.content.learn(mid)
        self._update_ghost(mid, lowered_ok=frozenset())  # stats set by this schedule()
        return before, step, mid, answers_before, asked

    def _execute(self, step: StepView, mid: Observation, a: dict, pending=None):
        """The worker runs a step, with the faults the action names, on the
        block tables the scheduler outputs told it (``_as_told``)."""
        failing = set(a.get("fail", ()))
        if a.get("fail_all"):
            failing |= set(self.content.loads)
        told = self._as_told(step, mid)

        def run_oracle():
            return self.content.execute(step, told, set(a.get("finish_loads", ())), failing,
                                        a.get("fail_offset", 0), a.get("fail_blocks", 1),
                                        pending=pending, fail_group=a.get("fail_group", 0))
        if self.worker is None:
            return run_oracle()
        self.features["kv_torch"] += 1
        return self.worker.execute(step, told, pending or {}, run_oracle)

    def _as_told(self, step: StepView, mid: Observation) -> Observation:
        """The state as the worker sees it: each scheduled request's block table
        as the scheduler outputs built it (``spec/worker.py``), as vLLM's model
        runner keeps it, where the worker keeps one: not for a last-state group,
        nor for a request a load failure cut back (the reference recomputes it
        in fresh blocks, which no output says). A scheduler that tells the
        worker something else has the KV written where it said."""
        if not self.worker_tables:
            return mid
        groups, requests = mid.config.groups, dict(mid.requests)
        for rid in step.num_scheduled_tokens:
            r, told = requests.get(rid), self.worker_tables.get(rid)
            if r is None or told is None or rid in self.ghost.recovered:
                continue
            tables = tuple(told[g] if g < len(told) and groups[g].kind != "last_state"
                           else table for g, table in enumerate(r.block_ids))
            requests[rid] = attrs.evolve(r, block_ids=tables)
        return attrs.evolve(mid, requests=requests)

    def _kv_violations(self) -> list[Violation]:
        """The torch worker's findings since the last call: blocks whose
        tensors disagree with the oracle, requests that ended with tokens or
        logits other than the no-cache model's."""
        if self.worker is None:
            return []
        return self.worker.take_violations(self.target.observe(), self.target.final_view)

    def _outcome(self, report, sampled: dict, a: dict, before: Observation) -> WorkerOutcome:
        """The worker's report of a step; its loads that landed are noted."""
        for rid in report.loaded_ok & set(before.requests):
            self.env.note_load_finished(rid, before.requests[rid].num_preemptions)
        return WorkerOutcome(
            sampled_token_ids=sampled,
            finished_recving=frozenset(report.finished_recving),
            finished_sending=frozenset(self._finish_sends(a)),
            invalid_block_ids=frozenset(report.invalid_block_ids))

    def _note_output_applied(self, before: Observation, after: Observation, report,
                             outcome: WorkerOutcome) -> None:
        """What the environment learns once a step's output is applied."""
        for rid in after.running:
            r = after.requests[rid]
            if rid not in report.garbage_readers:  # an offloading store keeps real tokens
                self.env.note_computed(rid, r.num_computed_tokens - r.num_output_placeholders,
                                       r.num_tokens)
        history.process_output_applied(self.ghost, before, after, outcome.finished_recving)

    # -- async scheduling -------------------------------------------------------
    def _do_async_step(self, a: dict) -> list[Violation]:
        """One ``EngineCore.step_with_batch_queue`` call: schedule a step and
        launch it (the worker runs it at once: its KV lands in stream order);
        unless the queue is full, or nothing was scheduled and nothing is
        left to schedule, return; otherwise apply the oldest step's output."""
        before = self.obs
        violations: list[Violation] = []
        if self._has_requests():
            step, mid, found = self._schedule_in_flight(a)
            violations += found
            more = step.total_num_scheduled_tokens > 0 or self._has_requests()
            if len(self.in_flight) < BATCH_QUEUE_DEPTH and more:
                return violations
            before = mid
        if not self.in_flight:
            return violations
        return violations + self._deliver_oldest(before, a)

    def _has_requests(self) -> bool:
        return bool(self.obs.requests)

    def _pending_tokens(self) -> dict[str, tuple[int, ...]]:
        """Tokens sampled by steps in flight that the scheduler has not seen: the
        worker feeds them to the next step (stale output excluded)."""
        pending: dict[str, tuple[int, ...]] = {}
        for job in self.in_flight:
            for rid, tokens in job.sampled.items():
                if rid not in job.stale:
                    pending[rid] = pending.get(rid, ()) + tokens
        return pending

    def _schedule_in_flight(self, a: dict):
        before, step, mid, answers_before, asked = self._schedule()
        self._count_async_schedule(step)
        shares = self._note_placeholders_scheduled(step, mid)
        self._tell_worker(step, mid)
        t = self._transition("schedule", before, mid, step=step,
                             worker_tables=self.worker_tables)
        hints = self._hints(before, mid, mid.requests, step, WorkerOutcome({}),
                            answers_before, self.env.answer_log[asked:])
        model_step = self._model_step(t, hints)
        found = self._check(mid, kinds=("state",), transition=t, model_step=model_step)
        self._advance_book(model_step)
        if found:  # the worker cannot run a broken step (positions past the tokens)
            self.obs = mid
            return step, mid, found
        pending = self._pending_tokens()
        work = self._worker_view(step, a, pending)
        self.features["draft_rollback_in_flight"] += (work.num_computed_before
                                                      != step.num_computed_before)
        report = self._execute(work, mid, a, pending)
        history.process_loads_finished(self.ghost, report.loaded_ok)
        sampled = self._sample(work, mid, a, pending)
        self.in_flight.append(InFlight(step, mid, report, sampled, shares=shares))
        self.obs = mid
        # the state again, synced (the real boundary), with the data the step wrote
        found = self._check(mid, kinds=("state", "data"))
        self.content.forget_completed()  # judged once, right after the step
        return step, mid, found

    def _worker_view(self, step: StepView, a: dict, pending: dict) -> StepView:
        """The step as the worker runs it. The scheduler planned it as if every
        draft of the step in flight were accepted; the worker has that step's
        output, so it runs each request from its real boundary, shifted down by
        the drafts rejected there, and fills the placeholder drafts (-1) with
        its drafter's proposals: ``drafts`` of them (the rest stay -1, as vLLM
        pads drafts a grammar rejects), each guessed for its real position."""
        starts, drafts = dict(step.num_computed_before), dict(step.scheduled_spec_decode_tokens)
        for rid in step.num_scheduled_tokens:
            starts[rid] -= self._rejected_in_flight(rid)
            if drafts.get(rid):
                first = self.obs.requests[rid].num_tokens + len(pending.get(rid, ()))
                drafts[rid] = tuple(draft_token(rid, first + k, k) if k < a.get("drafts", 0)
                                    and token < 0 else token
                                    for k, token in enumerate(drafts[rid]))
        return attrs.evolve(step, num_computed_before=starts,
                            scheduled_spec_decode_tokens=drafts)

    def _rejected_in_flight(self, rid: str) -> int:
        """Drafts of its steps in flight (output not stale) that their output rejects."""
        return sum(_num_rejected(job, rid) for job in self.in_flight if rid not in job.stale)

    def _count_async_schedule(self, step: StepView) -> None:
        self.features["async_scheduling"] += bool(self.in_flight and
                                                   step.total_num_scheduled_tokens)
        self.features["output_in_flight_at_preemption"] += bool(
            step.preempted_req_ids & self._in_flight_ids())

    def _in_flight_ids(self) -> set[str]:
        """Requests with output still in flight that is not stale."""
        return {rid for job in self.in_flight for rid in job.step.num_scheduled_tokens
                if rid not in job.stale}

    def _note_placeholders_scheduled(self, step: StepView, mid: Observation) -> dict[str, int]:
        """The ghost's placeholder count (``placeholders_match_in_flight``): a
        preempted request's output in flight turns stale and owns none; a step
        that schedules a request up to its last known token (and the placeholder
        positions) samples, and owns a share of 1 + its drafts. Counted here as
        the shares of the steps in flight, apart from ``spec/arith.py``'s rules,
        which the reference's bookkeeping (``impl/in_flight.py``) uses."""
        self._drop_output_in_flight(step.preempted_req_ids)
        shares, owned = {}, {}
        for rid, n in step.num_scheduled_tokens.items():
            held = self._shares_in_flight(rid)
            if step.num_computed_before[rid] + n >= mid.requests[rid].num_tokens + held:
                shares[rid] = 1 + len(step.scheduled_spec_decode_tokens.get(rid, ()))
            owned[rid] = held + shares.get(rid, 0)
        history.process_placeholders(self.ghost, owned)
        return shares

    def _shares_in_flight(self, rid: str) -> int:
        """What the steps in flight will sample for ``rid``, stale output aside."""
        return sum(job.shares.get(rid, 0) for job in self.in_flight if rid not in job.stale)

    def _drop_output_in_flight(self, request_ids) -> None:
        """Their output still in flight is stale (a preemption, or a recovery cut
        back under it): it is dropped, and they own no placeholders."""
        history.process_placeholders(self.ghost, {rid: 0 for rid in request_ids})
        for rid in request_ids:
            for job in self.in_flight:
                if rid in job.step.num_scheduled_tokens:
                    job.stale.add(rid)

    def _deliver_oldest(self, before: Observation, a: dict) -> list[Violation]:
        """The oldest step's output is back: its writes have all landed, then
        ``update_from_output`` applies it."""
        job = self.in_flight.pop(0)
        self.content.complete(job.report.step_id)
        report, step, mid = job.report, job.step, job.mid
        outcome = self._outcome(report, job.sampled, a, before)
        self.target.update_from_output(outcome)
        after = self.target.observe()
        holders = _invalid_holders(before, report)
        self._note_placeholders_delivered(job, before, after)
        departed = self._departed(before, after)
        # one preempted since the step ran (its output is stale) recomputes anyway
        readers = {rid: pos for rid, pos in report.garbage_readers.items()
                   if rid not in job.stale}
        t = self._transition("update_from_output", before, after, departed, step=step,
                             outcome=outcome, garbage_readers=readers)
        self._note_output_applied(before, after, report, outcome)
        self._count_features(step, outcome, mid)
        history.process_departed(self.ghost, after)
        hints = self._hints(before, before, after.requests | departed, step, outcome, {}, [],
                            _tainted_blocks(before, report), stale=job.stale)
        return self._settle(after, t, lowered_ok=holders,
                            model_step=self._model_step(t, hints))

    def _note_placeholders_delivered(self, job: InFlight, before: Observation,
                                     after: Observation) -> None:
        """A step's output returns its share. A running request that read KV a
        load failure invalidated, or that recovery cut back (which blocks of a
        holder of a failed block count is the scheduler's choice), has its
        output of this step and of every later step in flight computed on top
        of the failure: it is discarded, so it owns no placeholders."""
        history.process_placeholders(self.ghost, {
            rid: self._shares_in_flight(rid) for rid in job.sampled
            if rid not in job.stale and rid in self.ghost.placeholders})
        readers = set(job.report.garbage_readers) - job.stale
        cut = {rid for rid in before.running if rid in readers or _was_cut(rid, job, before, after)}
        self._drop_output_in_flight(cut)

    def _hints(self, before, mid, ended: dict, step: StepView, outcome: WorkerOutcome,
               answers_before: dict, asked: list, tainted=frozenset(),
               stale=frozenset()) -> dict[str, Hints]:
        """What the observation fixes about each request's step (spec/conformance.py);
        ``ended``: every request after the step, departed ones as they ended."""
        answers = {rid: (local, external) for rid, local, external in asked}
        hints = {}
        for rid, new in ended.items():
            old, was = before.requests.get(rid), mid.requests.get(rid)
            if old is None:
                continue
            tables = was.block_ids if was is not None else ()
            # the first failed block in any group: with several groups the
            # recovery rule is stated at the earliest one (spec/groups.py). A
            # request that had ended (held for a send) recovers nothing: the
            # taint may reach its blocks, its count stays as it was.
            bad = None if old.status.is_finished else min(
                (i for t in tables for i, b in enumerate(t)
                 if b in (tainted or outcome.invalid_block_ids)), default=None)
            hints[rid] = Hints(
                num_new=step.num_scheduled_tokens.get(rid, 0),
                num_drafts=len(step.scheduled_spec_decode_tokens.get(rid, ())),
                num_appended=len(new.output_token_ids) - len(old.output_token_ids),
                answer=answers.get(rid), load_answer=answers_before.get(rid),
                first_invalid_block=bad,
                # (a preemption since the step started it over: that start is gone)
                start=None if rid in stale else step.num_computed_before.get(rid),
                scheduled_stats=None if was is None else (was.num_cached_tokens,
                                                          was.num_external_computed_tokens),
                scheduled_blocks=0 if was is None else get_num_blocks(was, mid.config.groups),
                stale=rid in stale)
        return hints

    def _count_features(self, step: StepView, outcome: WorkerOutcome, mid: Observation) -> None:
        cfg, f = self.config, self.features
        live = sum(not r.status.is_finished for r in mid.requests.values())
        f["load_failures"] += bool(outcome.invalid_block_ids)
        f["async_loads"] += bool(outcome.finished_recving)
        f["preemptions"] += bool(step.preempted_req_ids)
        f["spec_decode"] += any(step.scheduled_spec_decode_tokens.values())
        f[f"failure_policy_{cfg.kv_load_failure_policy}"] += bool(outcome.invalid_block_ids)
        f[f"policy_{cfg.policy}"] += live >= 2
        f["sends"] += bool(outcome.finished_sending)
        if len(cfg.groups) > 1:
            self._count_group_features(step, outcome, mid)

    def _count_group_features(self, step: StepView, outcome: WorkerOutcome,
                              mid: Observation) -> None:
        """Several KV cache groups at work: a step over them; a sliding-window
        or last-state table that gave blocks back; a failed block outside the
        full-attention group."""
        f, groups = self.features, self.config.groups
        f["hybrid_groups"] += bool(step.num_scheduled_tokens)
        tables = [(groups[g].kind, t) for r in mid.requests.values()
                  for g, t in enumerate(r.block_ids)]
        for kind, feature in (("sliding_window", "sliding_window"),
                              ("last_state", "last_state_group")):
            f[feature] += any(k == kind and NULL_BLOCK in t for k, t in tables)
        f["load_failure_in_non_full_group"] += any(
            k != "full_attention" and set(t) & outcome.invalid_block_ids for k, t in tables)

    def _sample(self, step: StepView, mid: Observation, a: dict,
                pending: dict[str, tuple[int, ...]] | None = None) -> dict:
        """What the model samples for each request in this step: its accepted
        drafts and a bonus token (EOS where the environment says), each recorded
        at its position. ``pending``: tokens steps in flight sampled for it."""
        eos = set(a.get("eos", ()))
        sampled = {}
        for rid, n in step.num_scheduled_tokens.items():
            r = mid.requests[rid]
            known = r.num_tokens + len((pending or {}).get(rid, ()))
            start = step.num_computed_before[rid]
            if start + n < known:
                continue  # a partial prefill chunk samples nothing
            drafts = step.scheduled_spec_decode_tokens.get(rid, ())
            position = start + n - len(drafts)
            accepted = []
            # real tensors: the model verifies the drafts greedily; otherwise
            # the environment says how many it accepts
            accept = (a.get("accept", 0) if self.worker is None
                      else self.worker.count_accepted(rid, position, drafts))
            for token in drafts[:accept]:
                if token < 0:  # a padding slot (vLLM pads drafts with -1): never accepted
                    break
                accepted.append(token)
            if self.worker is not None:
                bonus = self.worker.greedy_token(rid, position + len(accepted), rid in eos)
            else:
                bonus = EOS_TOKEN_ID if rid in eos else sampled_token(rid, position + len(accepted))
            sampled[rid] = tuple(accepted + [bonus])
            history.process_sampled(self.ghost, rid, position, sampled[rid])
        return sampled

    def _finish_sends(self, a: dict) -> set[str]:
        done = set(a.get("finish_sends", ())) & set(self.content.sends)
        for rid in done:
            self.content.finish_send(rid)
        return done

    def _drafts(self, num: int) -> dict[str, list[int]]:
        if not num:
            return {}
        drafts = {}
        obs = self.target.observe()
        for rid in obs.running:
            r = obs.requests[rid]
            if r.num_computed_tokens == r.num_tokens - 1:  # decoding
                drafts[rid] = [draft_token(rid, r.num_tokens + k, k) for k in range(num)]
        return drafts

    def _do_abort(self, a: dict) -> list[Violation]:
        before = self.obs
        history.process_abort(self.ghost, before.requests.get(a["id"]))
        self.target.abort(a["id"])
        after = self.target.observe()
        t = self._transition("abort", before, after, request_id=a["id"])
        return self._settle(after, t, model_step=self._model_step(t))

    def is_kv_in_transfer(self) -> bool:
        """KV of a transfer is held outside the running requests: a load under
        way, a loaded request not yet running, a send, or a request that ended
        and holds its blocks until the worker reports its transfer."""
        return bool(self.content.loads) or bool(self.content.sends) or any(
            r.status != RequestStatus.RUNNING and any(r.block_ids or ())
            for r in self.obs.requests.values())

    def _do_reset_prefix_cache(self, a: dict) -> list[Violation]:
        before, forced = self.obs, bool(a.get("running"))
        if forced and self.is_kv_in_transfer():
            # vLLM raises then, saying it does not support it: not a call the
            # environment makes (the machine never asks for one)
            raise EnvironmentContractViolation(
                "a forced reset_prefix_cache while KV is in transfer (vLLM does not support it)")
        ok = self.target.reset_prefix_cache(forced)
        self.features["prefix_cache_resets"] += bool(ok)
        after = self.target.observe()
        preempted = {rid for rid in before.running if rid in after.requests
                     and after.requests[rid].status != RequestStatus.RUNNING}
        self.features["output_in_flight_at_preemption"] += bool(preempted & self._in_flight_ids())
        self._drop_output_in_flight(preempted)
        t = self._transition("reset_prefix_cache", before, after,
                             request_id=("forced:" if forced else "") + str(bool(ok)))
        return self._settle(after, t, model_step=self._model_step(t))

    def _do_drain(self, a: dict) -> list[Violation]:
        """The healed phase: no faults, every load and send completes."""
        bound = 20 + BATCH_QUEUE_DEPTH + sum(len(r.prompt_token_ids) + r.max_tokens
                                             for r in self.obs.requests.values())
        history.process_drain(self.ghost, self.obs)
        for _ in range(bound):
            if not self.obs.requests and not self.in_flight:
                break
            healed = {"op": "step", "finish_loads": self.content.pending_async_loads(),
                      "finish_sends": list(self.content.sends)}
            violations = self._do_step(healed) + self._kv_violations()
            if violations:
                return violations
            self._record({"op": "drain.step"}, ())
        inv = REGISTRY["every_request_finishes"]
        if not self.is_checked(inv):
            return []
        messages, witnessed = evaluate(inv, Context(self.obs, self.ghost, self.content))
        self.checks[inv.name] += 1
        self.witnessed[inv.name] += witnessed
        return [Violation(inv.name, m, inv.doc) for m in messages]
