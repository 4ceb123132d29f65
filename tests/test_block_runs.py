"""The data oracle writes a step's KV block by block (runs of slots, issue 30)
and judges exactly as the slot-by-slot worker model it replaces: after every
``execute`` and ``complete`` of random runs (load failures, async scheduling,
drafts, several groups, and mutants that write one slot twice, free blocks
under a step in flight or resume a last-state block mid-block), a copy of the
oracle taken just before, stepped by the slot-by-slot definition below, holds
the same slots and reports the same."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from kvspec.spec.groups import NULL_BLOCK
from kvspec.spec.oracle import (GARBAGE, ExecReport, FoundByStep, KVContent, _count_holders,
                                extend_prefix_keys, get_content)
from kvspec.spec.state import GroupSpec, RequestStatus, RequestView, StepView

from random_runs import run_machine


class SlotBySlot(KVContent):
    """The worker model as it was before runs: every scheduled position's slot
    written, snapshotted and recorded one at a time (stream state per slot in
    ``slot_writer`` and ``slot_in_flight``)."""

    def _compute(self, step, obs, report, pending):
        writes = {}
        for rid, n in step.num_scheduled_tokens.items():
            req = obs.requests[rid]
            known = req.all_token_ids + pending.get(rid, ())
            keys = list(self.book.keys_of(req))
            extend_prefix_keys(keys, known + tuple(step.scheduled_spec_decode_tokens.get(rid, ())),
                               len(keys))
            writes[rid] = (req.block_ids, keys, step.num_computed_before[rid], n)
        slots = {rid: self._slots_of(tables, start, n)
                 for rid, (tables, _keys, start, n) in writes.items()}
        before = {rid: {(b, s): self.slots[b][s] for _g, _p, b, s in slots[rid]}
                  for rid in writes}
        writer, recomputed, self.double_writes = {}, set(), []
        for rid, (_tables, keys, _start, _n) in writes.items():
            for g, pos, b, s in slots[rid]:
                self._write_slot(b, s, get_content(g, keys, pos))
                if b in self.failed_blocks:
                    recomputed.add(b)
                if writer.setdefault((b, s), rid) != rid:
                    self.double_writes.append((b, s, writer[(b, s)], rid))
        holders = _count_holders(obs)
        self.shared_recomputes = sum(holders.get(b, 0) >= 2 for b in recomputed)
        self.failed_blocks -= recomputed
        self.completed = [done for rid, (tables, keys, start, n) in writes.items()
                          for done in self._completed_blocks(rid, obs.requests[rid], tables,
                                                             keys, start, n)]
        # the fixed point of garbage readers is the oracle's own, over one-slot runs
        self._spread_garbage(writes, {rid: [(b, s, [GARBAGE]) for _g, _p, b, s in request_slots]
                                      for rid, request_slots in slots.items()}, before, report)
        mine = self.slot_in_flight[report.step_id] = {}
        for request_slots in slots.values():
            for _g, _p, b, s in request_slots:
                self.slot_writer[(b, s)] = report.step_id
                mine[(b, s)] = self.slots[b][s]

    def _slots_of(self, tables, start, n):
        found = []
        for g, table in enumerate(tables):
            size, one_state = self._size(g), self._keeps_one_state(g)
            for pos in range(start, start + n):
                index = pos // size
                if index < len(table) and table[index] != NULL_BLOCK:
                    found.append((g, pos, table[index], size - 1 if one_state else pos % size))
        return found

    def complete(self, step_id):
        self.changed_blocks.extend(self.unreported.pop(step_id, ()))
        for slot, value in self.slot_in_flight.pop(step_id, {}).items():
            if self.slot_writer.get(slot) == step_id:
                self._write_slot(slot[0], slot[1], value)


def _slot_by_slot_copy(content: KVContent) -> SlotBySlot:
    """A copy of ``content`` as the slot-by-slot model, its stream state per slot."""
    shadow = copy.deepcopy(content)
    shadow.__class__ = SlotBySlot
    shadow.slot_writer = {(b, s): step for b, steps in content.stream_writer.items()
                          for s, step in enumerate(steps) if step is not None}
    shadow.slot_in_flight = {
        step: {(b, lo + i): v for b, lo, values in runs for i, v in enumerate(values)}
        for step, runs in content.in_flight.items()}
    return shadow


def _judged(content: KVContent) -> tuple:
    """Everything the claims read from the worker model after a step (of the
    double writes, the first, which ``single_writer`` reports, and which there
    were: slot by slot, a last-state block written at several positions
    repeats its entry)."""
    return (content.slots, content.double_writes[:1], set(content.double_writes),
            content.failed_blocks, content.shared_recomputes, content.completed,
            content.unreported)


def _report(report: ExecReport) -> tuple:
    return (report.finished_recving, report.loaded_ok, report.invalid_block_ids,
            report.garbage_readers, report.garbage_blocks)


#: what each target's runs must include for the comparison to mean something
WHAT_IT_SHOWS = {"impl": "garbage", "mutant:free_under_step_in_flight": "clobbered"}


@pytest.mark.parametrize("target", ["impl", "mutant:free_under_step_in_flight",
                                    "mutant:mamba_resume_mid_block"])
def test_block_runs_judge_as_slot_by_slot(target, monkeypatch):

    from kvspec.harness.machine import machine_for
    run_execute, run_complete = KVContent.execute, KVContent.complete
    seen = {"steps": 0, "double": 0, "garbage": 0, "clobbered": 0}

    def execute(self, *args, **kwargs):
        shadow = _slot_by_slot_copy(self)
        got = run_execute(self, *args, **kwargs)
        want = run_execute(shadow, *args, **kwargs)
        assert _report(got) == _report(want) and _judged(self) == _judged(shadow)
        seen["steps"] += 1
        seen["double"] += bool(self.double_writes)
        seen["garbage"] += bool(got.garbage_readers)
        return got

    def complete(self, step_id):
        shadow = _slot_by_slot_copy(self)
        before = copy.deepcopy(self.slots)
        run_complete(self, step_id)
        SlotBySlot.complete(shadow, step_id)
        assert self.slots == shadow.slots and self.unreported == shadow.unreported
        seen["clobbered"] += self.slots != before
    monkeypatch.setattr(KVContent, "execute", execute)
    monkeypatch.setattr(KVContent, "complete", complete)
    # a mutant's violation ends its run quietly: the worker model is what is judged here
    machine = machine_for(target, on_counterexample=lambda exc: True)
    run_machine(machine, 5, 60, 30)
    assert seen["steps"] > 100, seen
    assert seen[WHAT_IT_SHOWS.get(target, "steps")] > 0, seen


def test_found_by_step_reads_as_the_slot_dict():
    """``FoundByStep.of`` a (block, slot) dict reads each slot as the dict
    does, and every other slot as the block holds it."""
    import random
    rng = random.Random(3)
    for _ in range(300):
        slots = [[rng.choice([GARBAGE, 1, 2]) for _ in range(4)] for _ in range(5)]
        given = {(rng.randrange(5), rng.randrange(4)): rng.choice([GARBAGE, 7, 8])
                 for _ in range(rng.randint(0, 4))}
        found = FoundByStep.of(given)
        assert set(found) == {b for b, _s in given}
        for b in range(5):
            for s in range(4):
                assert found.read(slots[b], b, s) == given.get((b, s), slots[b][s])


GROUPS = [
    (GroupSpec(4),),
    (GroupSpec(4), GroupSpec(4, "sliding_window", 5)),
    (GroupSpec(4), GroupSpec(2, "last_state")),
    (GroupSpec(2), GroupSpec(4, "sliding_window", 3), GroupSpec(4, "last_state")),
]


def _random_step(rng, content: KVContent, groups):
    """Requests whose tables share blocks at random (two writers of a slot),
    with gaps, drafts and tokens in flight, computing from anywhere."""
    requests, scheduled, before, drafts, pending = {}, {}, {}, {}, {}
    for i in range(rng.randint(1, 4)):
        rid = f"r{i}"
        prompt = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 14)))
        tables = tuple(tuple(rng.choice([NULL_BLOCK] + [rng.randrange(1, 10)] * 6)
                             for _ in range(rng.randint(0, 20 // g.block_size)))
                       for g in groups)
        requests[rid] = RequestView(rid, RequestStatus.RUNNING, prompt, (), 8,
                                    rng.randint(0, len(prompt)), 0, 0, 0, tables)
        before[rid] = rng.randint(0, len(prompt))
        scheduled[rid] = rng.randint(0, len(prompt) + 3 - before[rid])
        if rng.random() < 0.3:
            drafts[rid] = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, 2)))
        if rng.random() < 0.2:
            pending[rid] = (rng.randint(0, 3),)
    step = StepView(scheduled, before, drafts, (), (), frozenset())
    return step, SimpleNamespace(requests=requests), pending


@pytest.mark.parametrize("groups", GROUPS, ids=range(len(GROUPS)))
def test_block_runs_write_as_slot_by_slot_at_random(groups):
    """Shared, broken and partial tables, drafts and tokens in flight; failed
    blocks to recompute; steps completed out of order."""
    import random
    rng = random.Random(len(groups))
    content = KVContent(10, 4, groups)
    double = 0
    for _ in range(400):
        content.failed_blocks = {b for b in range(10) if rng.random() < 0.1}
        step, obs, pending = _random_step(rng, content, groups)
        shadow = _slot_by_slot_copy(content)
        got = content.execute(step, obs, set(), set(), 0, pending=pending)
        want = SlotBySlot.execute(shadow, step, obs, set(), set(), 0, pending=pending)
        assert _report(got) == _report(want) and _judged(content) == _judged(shadow)
        double += bool(content.double_writes)
        if content.in_flight and rng.random() < 0.7:
            step_id = rng.choice(list(content.in_flight))
            shadow = _slot_by_slot_copy(content)
            content.complete(step_id)
            SlotBySlot.complete(shadow, step_id)
            assert content.slots == shadow.slots
    assert double > 20
