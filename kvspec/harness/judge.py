"""What the runner's calls are judged on: the transition each call made, the
conformance model's view of it (``ModelStep``, with the model's book of what
it has admitted so far), and the claims evaluated on them and on the state
the call left. The ghosts are advanced by ``spec/history.py``; claims are pure."""
from __future__ import annotations

from collections import Counter

from kvspec.harness.checker import Checker
from kvspec.harness.features import OUTSIDE_MODEL
from kvspec.harness.hints import compute_hints
from kvspec.spec import history
from kvspec.spec.actions import Transition
from kvspec.spec.conformance import ModelBook, ModelStep, compute_admission
from kvspec.spec.history import Ghost
from kvspec.spec.invariants import Context
from kvspec.spec.oracle import KVContent
from kvspec.spec.registry import REGISTRY, Violation
from kvspec.spec.state import Observation


class Judge:
    def __init__(self, checker: Checker, ghost: Ghost, content: KVContent, target,
                 features: Counter) -> None:
        self.checker, self.ghost, self.content, self.target = checker, ghost, content, target
        self.features = features
        #: what the conformance model has admitted so far (its own ghost)
        self.book = ModelBook()

    def check(self, obs: Observation, kinds=("state", "data"), transition=None,
              model_step: ModelStep | None = None) -> list[Violation]:
        after_step = transition is not None and transition.action == "update_from_output"
        ctx = Context(obs, self.ghost, self.content, synced="data" in kinds, after_step=after_step)
        return self.checker.check(ctx, kinds, transition, model_step)

    def settle(self, after: Observation, transition: Transition, answers: dict,
               lowered_ok=frozenset(), model_step: ModelStep | None = None) -> list[Violation]:
        """The call is over: the ghosts learn its state, every claim judges it."""
        self.content.learn(after)
        history.process_observation(self.ghost, after, answers, lowered_ok)
        self.features[OUTSIDE_MODEL] += model_step is None  # none do: check --json says so
        found = self.check(after, transition=transition, model_step=model_step)
        self.advance_book(model_step)
        return found

    def advance_book(self, model_step: ModelStep | None) -> None:
        """The model's ghost moves on past a judged action."""
        if model_step is not None and model_step.admission is not None:
            self.book = model_step.admission.get_book()

    def get_transition(self, action: str, before: Observation, after: Observation,
                       departed=None, **kwargs) -> Transition:
        departed = self.get_departed(before, after) if departed is None else departed
        return Transition(action, before, after, departed=departed,
                          first_hits=dict(self.ghost.first_hits),
                          recovered=frozenset(self.ghost.recovered),
                          mid_load=frozenset(self.ghost.finished_mid_load), **kwargs)

    def get_departed(self, before: Observation, after: Observation) -> dict:
        """Requests that left the scheduler during an action, as they ended."""
        gone = {rid: self.target.final_view(rid) for rid in before.requests
                if rid not in after.requests}
        return {rid: view for rid, view in gone.items() if view is not None}

    def get_model_step(self, t: Transition, hints=None) -> ModelStep:
        """The conformance claim's view of an action (from the state before it)."""
        step = ModelStep(t.action, t.before, t.after, hints or {}, self.book, t.request_id,
                         departed=t.departed)
        if self.checker.is_checked(REGISTRY["transition_admitted_by_model"]):
            step.admission = compute_admission(step)
        return step

    def get_delivery_step(self, job, t: Transition, outcome, is_sync: bool,
                          tainted: set[int], later=()) -> ModelStep:
        """The model's view of a step's output coming back: async, the output
        alone; synchronous (a batch queue of depth 1), the schedule and its
        output as one step. ``job``: the step, as the batch queue kept it;
        ``tainted``: the blocks its failed loads left invalid
        (``get_tainted_blocks``); ``later``: the steps still in flight after it."""
        ended = t.after.requests | t.departed
        if not is_sync:
            return self.get_model_step(t, compute_hints(
                t.before, t.before, ended, job.step, outcome, {}, [], tainted, stale=job.stale,
                later=later))
        hints = compute_hints(job.before, job.mid, ended, job.step, outcome, job.answers_before,
                              job.asked, tainted)
        return self.get_model_step(self.get_transition("step", job.before, t.after, t.departed),
                                   hints)

    def check_liveness(self, obs: Observation) -> list[Violation]:
        """After the healed phase: every request that was live has finished."""
        inv = REGISTRY["every_request_finishes"]
        if not self.checker.is_checked(inv):
            return []
        return self.checker.judge(inv, Context(obs, self.ghost, self.content))
