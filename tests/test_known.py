"""Known findings recognised by behaviour (kvspec/harness/known.py), and runs that
go on past them instead of narrowing the environment (kvspec/harness/fuzz.py)."""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.harness.fuzz import fuzz
from kvspec.harness.known import (Explanation, Outcome, Recogniser, behaves_as, recorded,
                                  template)
from kvspec.harness.machine import machine_for
from kvspec.harness.replay import replay_trace
from kvspec.spec.registry import Violation

MUTANT = "mutant:async_block_rounding"


def test_template_takes_out_what_varies():
    a = "r3: token 12 is counted as computed (num_computed=14) but its KV is not valid"
    b = "r0: token 2 is counted as computed (num_computed=5) but its KV is not valid"
    assert template(a) == template(b)
    assert template("AssertionError: v1/core/sched/scheduler.py:1234: assert x "
                    "(kvspec patches: a, b)") == template(
        "AssertionError: v1/core/sched/scheduler.py:99: assert x")


def test_behaves_as_needs_the_same_claims_and_message_shapes():
    want = (("target_crashed", "RuntimeError: A KV connector reported block-level load "
                               "failures (invalid_block_ids) which is not supported"),)
    assert behaves_as(want, want)
    assert not behaves_as((("target_crashed", "ValueError: too many values to unpack"),), want)
    assert not behaves_as(want + (("computed_means_valid", "r0: x"),), want)
    assert not behaves_as((), want)


class FakeBase:
    label = "fake base"

    def __init__(self, outcome: Outcome) -> None:
        self.outcome, self.asked = outcome, []

    def target_for(self, applied) -> str:
        return "vllm?fixes=" + ",".join(sorted(applied))

    def replay(self, target, config, actions):
        self.asked.append(target)
        return self.outcome


def violations(*pairs):
    return [Violation(c, m, "") for c, m in pairs]


def test_a_counterexample_that_fails_on_the_base_too_is_pre_existing():
    base = FakeBase(Outcome((("computed_means_valid", "r1: token 0 ..."),)))
    rec = Recogniser("vllm", {"a-fix"}, [], [], base)
    why = rec.explain({"c": 1}, [{"op": "drain"}],
                      violations(("computed_means_valid", "r0: token 0 ...")))
    assert why is not None and why.finding is None and "fails on the base" in why.how
    assert base.asked == ["vllm?fixes=a-fix"]  # the base runs with the head's fixes


def test_a_base_that_shares_one_claim_of_two_does_not_explain_it():
    """A change that keeps a known bug and breaks a second claim in its step
    has a failure of its own: sharing one claim is not "fails on the base too"."""
    base = FakeBase(Outcome((("computed_means_valid", "r1: token 0 ..."),), step=2))
    rec = Recogniser("vllm", set(), [], [], base)
    found = violations(("computed_means_valid", "r0: token 0 ..."),
                       ("ref_count_is_holders", "block 3 counts 2, held by 1"))
    actions = [{"op": "add"}, {"op": "step"}, {"op": "step"}]
    assert rec.explain({}, actions, found) is None
    note = rec.get_base_note({}, actions, found)
    assert note == ("BASE fails this trace too, as computed_means_valid, "
                    "but not as ref_count_is_holders")


def test_a_base_that_fails_earlier_otherwise_does_not_explain_it():
    """The base breaks the claim at an earlier action, another way: the head
    passed that action, so its failure at the last one is its own."""
    base = FakeBase(Outcome((("computed_means_valid", "block 4 holds garbage"),), step=0))
    rec = Recogniser("vllm", set(), [], [], base)
    found = violations(("computed_means_valid", "r0: token 0 ..."))
    actions = [{"op": "add"}, {"op": "step"}, {"op": "step"}]
    assert rec.explain({}, actions, found) is None
    assert rec.get_base_note({}, actions, found) == (
        "BASE fails this trace earlier, at action 1 of 3, and otherwise: computed_means_valid")


def test_a_known_failure_the_change_moved_earlier_or_later_is_pre_existing():
    """The same violations (message shapes) earlier on the base: a known
    failure whose timing the change moved, not the change's own."""
    base = FakeBase(Outcome((("computed_means_valid", "r1: token 4 ..."),), step=0))
    rec = Recogniser("vllm", set(), [], [], base)
    why = rec.explain({}, [{"op": "add"}, {"op": "step"}, {"op": "step"}],
                      violations(("computed_means_valid", "r0: token 0 ...")))
    assert why is not None and "earlier in the trace" in why.how


def test_a_drain_step_counts_as_earlier():
    """A drain's steps are rows of one action: the base failing at an earlier
    row of the last action is earlier too."""
    base = FakeBase(Outcome((("every_request_finishes", "r2 never finished"),), step=1, row=3))
    rec = Recogniser("vllm", set(), [], [], base)
    actions, found = [{"op": "add"}, {"op": "drain"}], violations(("every_request_finishes",
                                                                   "r2 never finished, ..."))
    assert rec.explain({}, actions, found, rows=31) is None
    assert "earlier" in rec.get_base_note({}, actions, found)
    rec = Recogniser("vllm", set(), [], [], base)
    assert rec.explain({}, actions, found, rows=4) is not None  # the same row: the same way


def test_another_crash_at_the_same_action_is_the_heads_own():
    base = FakeBase(Outcome((("target_crashed", "KeyError: 'r1'"),), step=1))
    rec = Recogniser("vllm", set(), [], [], base)
    found = violations(("target_crashed", "AssertionError: scheduler.py:12: x"))
    assert rec.explain({}, [{"op": "add"}, {"op": "step"}], found) is None
    assert "crashes otherwise: KeyError" in rec.get_base_note(
        {}, [{"op": "add"}, {"op": "step"}], found)


def test_a_base_that_passes_is_noted_as_passing():
    rec = Recogniser("vllm", set(), [], [], FakeBase(Outcome()), base_decides=True)
    found = violations(("computed_means_valid", "r0"))
    assert rec.explain({}, [{"op": "step"}], found) is None
    assert rec.get_base_note({}, [{"op": "step"}], found) == ""


def test_in_a_review_kvspecs_own_crash_on_the_base_too_is_not_the_change():
    crash = ("kvspec_crashed", "IndexError at spec/oracle.py:12: list index out of range")
    base = FakeBase(Outcome((crash,), step=0))
    review = Recogniser("vllm", set(), [], [], base, base_decides=True)
    why = review.explain({}, [{"op": "step"}], violations(crash))
    assert why is not None and why.finding is None and "bug in kvspec" in why.how
    assert why.key == "kvspec's own crash"
    # a check never excuses it, base or not
    check = Recogniser("vllm", set(), [], [], base)
    assert check.explain({}, [{"op": "step"}], violations(crash)) is None


def test_a_base_failing_at_the_same_action_with_more_claims_explains_it():
    base = FakeBase(Outcome((("computed_means_valid", "x"), ("stats_are_ordered", "y")),
                            step=1))
    rec = Recogniser("vllm", set(), [], [], base)
    found = violations(("computed_means_valid", "r0"))
    why = rec.explain({}, [{"op": "add"}, {"op": "step"}], found)
    assert why is not None and "fails on the base" in why.how
    assert rec.get_base_note({}, [{"op": "add"}, {"op": "step"}], found) is None


def test_replay_says_at_which_action_it_failed(tmp_path):
    from kvspec.harness.known import replay
    ce = fuzz(MUTANT, budget=20, seed=0, out_dir=tmp_path).counterexample
    assert ce is not None
    actions = list(ce.runner.actions)
    got = replay(MUTANT, ce.runner.config, actions + [{"op": "step"}] * 3)
    assert got.fails and got.step == len(actions) - 1
    assert got.row == len(ce.runner.log) - 1  # the fuzzer's rows and a replay's agree
    # and a review's base process says so too (its side of the protocol)
    from kvspec.harness.base_worker import _handle
    from kvspec.harness.trace import config_to_dict
    answer = _handle({"op": "replay", "target": MUTANT, "actions": actions,
                      "config": config_to_dict(ce.runner.config)})
    assert answer["step"] == len(actions) - 1 and answer["violations"]
    assert answer["row"] == got.row


def test_a_known_findings_shape_names_it_on_the_base():
    trace = "vllm-0.32.0-hybrid-sync-load-failure-unreportable.json"
    base = FakeBase(Outcome(recorded(trace)))
    why = Recogniser("vllm", set(), [], [], base).explain({}, [], violations(*recorded(trace)))
    assert why.finding == "hybrid-sync-load-failure-unreportable" and why.upstream


def test_a_counterexample_that_passes_on_the_base_is_new():
    rec = Recogniser("vllm", set(), [], [], FakeBase(Outcome()))
    assert rec.explain({}, [], violations(("computed_means_valid", "r0"))) is None


def test_other_claims_on_the_base_do_not_explain_it():
    rec = Recogniser("vllm", set(), [], [], FakeBase(Outcome((("stats_are_ordered", "x"),))))
    assert rec.explain({}, [], violations(("computed_means_valid", "r0"))) is None


def test_the_environments_own_contract_is_never_a_known_finding():
    rec = Recogniser("vllm", set(), [], [], FakeBase(Outcome((("environment_contract", "x"),))))
    assert rec.explain({}, [], violations(("environment_contract", "x"))) is None


def test_a_base_that_cannot_answer_explains_nothing_and_is_reported():
    class Broken(FakeBase):
        def replay(self, *a):
            raise RuntimeError("gone")
    rec = Recogniser("vllm", set(), [], [], Broken(Outcome()))
    assert rec.explain({}, [], violations(("computed_means_valid", "r0"))) is None
    assert rec.base_errors and "gone" in rec.base_errors[0]


class ExplainAll:
    """A recogniser that explains every counterexample as one known finding."""

    is_active = True
    base_errors: list = []

    def explain(self, config, actions, found, rows=None):
        return Explanation("some-known-finding", "stand-in", "upstream #1")


def test_a_run_goes_on_past_a_known_finding_and_keeps_its_trace(tmp_path):
    result = fuzz(MUTANT, budget=4, seed=0, out_dir=tmp_path, recogniser=ExplainAll())
    assert result.counterexample is None and result.trace_path is None
    hit = result.known["some-known-finding"]
    assert hit.count >= 2, "the run stopped at the first known finding"
    assert hit.trace_path.is_file() and hit.trace_path.parent.name == "known"
    assert replay_trace(hit.trace_path).violations  # it replays, failing, as saved
    assert not list(tmp_path.glob(".pending-*"))


def test_a_new_counterexample_is_never_shrunk_into_a_known_one(tmp_path):
    """Shrinking asks the recogniser too: with every counterexample known but
    those breaking computed_means_valid, the trace kept still breaks it. The
    known finding's count is of runs, not of the shrinker's candidates."""
    class KnownUnlessComputed(ExplainAll):
        seen_new, before, during = False, 0, 0

        def explain(self, config, actions, found, rows=None):
            if any(v.invariant == "computed_means_valid" for v in found):
                self.seen_new = True
                return None
            self.during += self.seen_new
            self.before += not self.seen_new
            return super().explain(config, actions, found, rows)
    rec = KnownUnlessComputed()
    result = fuzz(MUTANT, budget=20, seed=0, out_dir=tmp_path, recogniser=rec)
    assert result.counterexample is not None
    assert "computed_means_valid" in {v.invariant for v in result.counterexample.violations}
    saved = json.loads(result.trace_path.read_text())
    assert "computed_means_valid" in {v["invariant"] for v in saved["verdict"]}
    assert rec.during > 0, "no shrink candidate met the known finding: nothing was tested"
    hit = result.known.get("some-known-finding")
    assert (hit.count if hit else 0) == rec.before
    assert not list(tmp_path.glob(".pending-*"))


def test_past_the_deadline_a_run_does_nothing():
    """The budget bounds shrinking: past the deadline every action is skipped,
    so a shrink candidate passes and shrinking stops."""
    machine = machine_for(MUTANT, deadline=time.monotonic() - 1)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=5, stateful_step_count=10, deadline=None, database=None,
        suppress_health_check=list(HealthCheck), phases=(Phase.generate,)))
    assert machine.stats["runs"] > 0 and machine.stats["actions"] == 0


@pytest.mark.parametrize("budget", [2])
def test_shrinking_within_the_budget_is_said(tmp_path, budget):
    result = fuzz(MUTANT, budget=budget, seed=0, out_dir=tmp_path)
    assert result.counterexample is not None and result.shrink_started is not None
    assert result.trace_path.is_file()


def test_a_pre_existing_counterexample_is_named_by_the_fix_that_closes_it_on_the_base():
    """A fix that does not fit the head (its code changed) still fits the base:
    the counterexample that fails there too passes there with it, which names
    the finding, whatever other finding's message it resembles."""
    fix = "recovery-cuts-every-request-at-its-first-failed-block"

    class Base(FakeBase):
        def replay(self, target, config, actions):
            self.asked.append(target)
            return Outcome() if fix in target else Outcome(
                (("no_caching_of_invalid_blocks", "block 4 is in the prefix cache"),))
    base = Base(Outcome())
    rec = Recogniser("vllm", {"priority-preempt-caches-uncomputed-block"}, [], [], base,
                     base_toggles=[fix])
    why = rec.explain({}, [], violations(("no_caching_of_invalid_blocks",
                                          "block 5 is in the prefix cache")))
    assert why.finding in ("recompute-failed-block-stays-cached",
                           "fail-policy-shared-failure-downstream-cached"), why
    assert f"passes there with {fix}" in why.how


def test_a_finding_whose_fix_is_applied_is_never_named_by_its_shape():
    trace = "vllm-0.32.0-priority-preempt-caches-uncomputed-block.json"
    base = FakeBase(Outcome(recorded(trace)))
    applied = {"priority-preempt-caches-uncomputed-block"}
    why = Recogniser("vllm", applied, [], [], base).explain({}, [], violations(*recorded(trace)))
    assert why is not None and why.finding != "priority-preempt-caches-uncomputed-block"


def test_a_check_knows_a_finding_with_no_fix_that_its_source_has_even_if_the_base_lacks_it():
    """``check --vllm`` asks its base only to recognise; ``review`` asks it to decide."""
    from kvspec.harness.accepted_findings import catalogue
    trace = "vllm-0.28.0-hybrid-block-failure-unpack-crash.json"
    finding = catalogue()["hybrid-block-failure-unpack-crash"]
    passes = FakeBase(Outcome())
    check = Recogniser("vllm", set(), [], [finding], passes)
    assert check.explain({}, [], violations(*recorded(trace))).finding == finding.id
    review = Recogniser("vllm", set(), [], [finding], passes, base_decides=True)
    assert review.explain({}, [], violations(*recorded(trace))) is None


def test_only_a_crash_vllm_wrote_is_recognised_by_its_shape():
    """A liveness or counter message is kvspec's own, shared by unrelated bugs:
    a change's new deadlock must never pass for a known one."""
    from kvspec.harness.accepted_findings import catalogue
    from kvspec.harness.known import is_recognisable_by_shape
    found = catalogue()
    assert is_recognisable_by_shape(found["hybrid-sync-load-failure-unreportable"])
    assert is_recognisable_by_shape(found["hybrid-block-failure-unpack-crash"])
    assert not is_recognisable_by_shape(found["waiting-head-blocks-finished-load"])
    assert not is_recognisable_by_shape(found["full-async-hit-external-exceeds-cached"])


def test_a_fix_that_leaves_only_a_known_finding_with_no_fix_names_its_own(monkeypatch):
    """One trace can meet two findings, the second hidden behind the first (a
    --strict run on 0.32.0 found one: the placeholder-draft assert, then the
    hybrid load-failure crash). The fix whose finding the counterexample fails as
    names it; a fix that only steers the trace onto the second does not."""
    from kvspec.harness import known
    from kvspec.harness.accepted_findings import catalogue
    found = catalogue()
    pad, hybrid = found["spec-pad-clipped-by-prefill-threshold"], \
        found["hybrid-sync-load-failure-unreportable"]
    first = recorded(pad.traces[0])
    behind = recorded(hybrid.traces[0])
    steer = "abort-mid-load-frees-under-send"

    def fake_replay(target, config, actions):
        return Outcome(behind) if (pad.fix_id in target or steer in target) else Outcome(first)
    monkeypatch.setattr(known, "replay", fake_replay)
    rec = Recogniser("vllm?fixes=none", set(), [steer, pad.fix_id], [hybrid])
    why = rec.explain({}, [], violations(*first))
    assert why.finding == pad.id, why
    assert f"it then fails only as {hybrid.id}" in why.how


class FakeProbes:
    """A ProbeCache answering HEAD's replays from a table (trace, target)."""

    def __init__(self, answers: dict) -> None:
        self.answers, self.asked = answers, []

    def probe(self, trace, target):
        self.asked.append((trace, target))
        return self.answers.get(trace, Outcome())


def test_a_review_leaves_out_a_fix_whose_path_the_change_handles_its_own_way():
    """Review battery edit 06 frees a preempted request's blocks at once, written
    as a fix of the forced-reset crash. kvspec's own fix of that crash refuses
    the reset first, so over it the edit's path never ran and the review passed.
    A fix whose finding's trace HEAD (without it) replays otherwise than BASE
    (without it) is left out on both sides; one replayed alike stays applied."""
    from kvspec.harness.accepted_findings import findings_of_fix
    from kvspec.harness.known import FixStatus, get_handled
    fix = "forced-reset-refuses-with-step-in-flight"
    other = "priority-preempt-caches-uncomputed-block"
    trace, = findings_of_fix(fix)[0].traces
    crash = Outcome((("target_crashed", "RuntimeError: Failed to reset KV cache"),))
    statuses = [FixStatus(fix, "applied"), FixStatus(other, "applied"),
                FixStatus("not-this", "not-needed")]
    applied = {fix, other}
    # HEAD passes the finding's trace without the fix; BASE crashes as recorded
    handled = get_handled(statuses, applied, FakeProbes({}), FakeBase(crash))
    assert [h.fix for h in handled] == [fix, other]  # the fake base crashes on every trace
    probes = FakeProbes({trace: crash})
    base = FakeBase(crash)
    handled = get_handled(statuses, applied, probes, base)
    assert fix not in [h.fix for h in handled]  # HEAD crashes as BASE does: kept applied
    assert (trace, f"vllm?fixes={other}") in probes.asked
    assert f"vllm?fixes={other}" in base.asked  # both sides without the fix alone
    changed = Outcome((("computed_means_valid", "r1: token 3 is counted as computed"),))
    handled = get_handled(statuses, applied, FakeProbes({trace: changed}), FakeBase(crash))
    assert fix in [h.fix for h in handled]
    assert "otherwise than BASE" in handled[0].detail
    # a base that cannot answer leaves the fix applied
    assert fix not in [h.fix for h in get_handled(
        statuses, applied, FakeProbes({}), FakeBase(Outcome(error="boom")))]
