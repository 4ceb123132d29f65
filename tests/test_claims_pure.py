"""Claims are pure (issue 25): a claim judges what it is given and changes
nothing, so evaluating it twice gives the same verdict, and what it judged
(the observation, the ghosts, the model's book, the data oracle) is as before.
Only the runner advances the ghosts (``transition_admitted_by_model`` once
wrote the model's own while it was evaluated)."""
from __future__ import annotations

import io
import pickle

from kvspec.harness import checker as checker_module
from kvspec.harness.fuzz import fuzz
from kvspec.spec.oracle import KeyBook, OfferedAtStart
from kvspec.spec.registry import REGISTRY, evaluate


class _StatePickler(pickle.Pickler):
    """Pickles what a claim judges, less the oracle's memo of prefix keys (a
    cache a claim may fill: it changes no answer), and what the cache offered
    at the step's start as the values it holds (a claim reading the cache
    brings the live books up to date: the start is the same set, though
    built of other, equal objects)."""

    def reducer_override(self, obj):
        if isinstance(obj, KeyBook):
            return KeyBook, ()
        if isinstance(obj, OfferedAtStart):
            return str, (repr(sorted(map(repr, obj))),)
        return NotImplemented


def _state(subject) -> bytes:
    subject.witnessed = 0  # the count a claim reports through, reset by evaluate
    out = io.BytesIO()
    _StatePickler(out).dump(subject)
    return out.getvalue()


def test_evaluating_a_claim_twice_gives_the_same_verdict_and_changes_nothing(
        monkeypatch, tmp_path):
    real_judge = checker_module.Checker.judge  # every claim evaluation goes through it
    seen: dict[str, int] = {}
    impure: list[str] = []

    def twice(self, inv, subject):
        before = _state(subject)
        first = evaluate(inv, subject)
        if _state(subject) != before:
            impure.append(f"{inv.name} changed what it judged")
        if evaluate(inv, subject) != first:
            impure.append(f"{inv.name} judged the same thing twice differently")
        seen[inv.name] = seen.get(inv.name, 0) + 1
        return real_judge(self, inv, subject)
    monkeypatch.setattr(checker_module.Checker, "judge", twice)
    result = fuzz("impl", budget=8, seed=5, out_dir=tmp_path)
    assert result.runs > 0 and result.counterexample is None
    assert not impure, sorted(set(impure))[:5]
    kinds = {REGISTRY[name].kind for name in seen}
    assert {"state", "data", "relation", "model"} <= kinds, kinds
    assert seen.get("transition_admitted_by_model"), "the model claim was never evaluated"


def test_repetition_detection_earns_a_stop_kvspec_does_not_model():
    """vLLM's FINISHED_REPETITION reads as FINISHED_STOPPED: with repetition
    detection on, a stop after a repeated pattern of ordinary tokens is
    earned (a maintainer's review: the finish relation once flagged it)."""
    from types import SimpleNamespace

    from kvspec.spec.actions import is_stop_earned
    r = SimpleNamespace(samples_tokens=True, output_token_ids=(3, 4, 3, 4), eos_token_id=0,
                        stop_token_ids=(), detects_repetition=False, min_tokens=0,
                        num_computed_tokens=9, num_prompt_tokens=5)
    assert not is_stop_earned(r)
    on = {**vars(r), "detects_repetition": True}
    assert is_stop_earned(SimpleNamespace(**on))
    assert not is_stop_earned(SimpleNamespace(**{**on, "output_token_ids": ()}))
    # vLLM looks for a pattern only from min_tokens outputs on
    assert not is_stop_earned(SimpleNamespace(**{**on, "min_tokens": 5}))
