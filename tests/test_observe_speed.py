"""The cheaper observation of issue 30 observes exactly as before: every call
of ``ImplTarget.observe``, ``observe_request`` and ``final_view`` equals a
view copied afresh from the scheduler (the observation as it was before it
reused anything), on random runs of the reference and of mutants, and under a
scheduler that writes counts, the free queue and request lists behind the
scheduler's back (in place, keeping lengths). What is unchanged comes back as
the very same objects, which is what makes it cheap to compare."""
from __future__ import annotations

import copy
import random
from collections import Counter

import pytest
from hypothesis import Phase

from kvspec.harness.env import RequestSpec
from kvspec.harness.machine import machine_for
from kvspec.harness.target import ImplTarget, make_config
from kvspec.impl import Scheduler
from kvspec.impl.mutants import MUTANTS
from kvspec.spec.state import (Observation, PoolView, RequestStatus, RequestView,
                               WorkerOutcome)

from random_runs import run_machine


def _view_afresh(r, tables) -> RequestView:
    """A request's view with every field copied anew (``tables``: its blocks per group)."""
    return RequestView(
        request_id=r.request_id, status=r.status, prompt_token_ids=tuple(r.prompt_token_ids),
        output_token_ids=tuple(r.output_token_ids), max_tokens=r.max_tokens,
        num_computed_tokens=r.num_computed_tokens, num_cached_tokens=r.num_cached_tokens,
        num_external_computed_tokens=r.num_external_computed_tokens,
        num_preemptions=r.num_preemptions,
        block_ids=tuple(tuple(b.block_id for b in group) for group in tables),
        block_hashes=tuple(r.block_hashes), spec_token_ids=tuple(r.spec_token_ids),
        num_output_placeholders=r.num_output_placeholders, priority=r.priority,
        eos_token_id=r.eos_token_id)


def observe_afresh(target: ImplTarget) -> Observation:
    """The whole observation copied anew: each count and free-queue entry read
    from its block, each view from its request."""
    s = target.scheduler
    pool = s.kv.pool
    requests = {rid: _view_afresh(r, s.kv.get_blocks(rid)) for rid, r in s.requests.items()}
    return Observation(
        config=target.config, requests=requests,
        waiting=tuple(r.request_id for r in s.waiting),
        running=tuple(r.request_id for r in s.running),
        pool=PoolView(ref_cnt=tuple(b.ref_cnt for b in pool.blocks),
                      free_queue=tuple(b.block_id for b in pool.free_queue),
                      cached=pool.get_cached_entry_ids(),
                      fenced=s.in_flight.get_fenced_block_ids()),
        sending=tuple(rid for rid, r in requests.items() if r.status.is_finished))


class StaleObservation(Exception):
    """An observation differs from one made afresh (not an AssertionError: the
    meddling test tolerates those, from the scheduler's own asserts)."""


class Checked:
    """The calls compared, and every difference found (the runner takes an
    exception inside a call for the target's crash, which a mutant's run
    shrugs off: the differences are kept here too)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.stale: list[str] = []

    def assert_same(self, got, want, what: str) -> None:
        if got != want:
            self.stale.append(f"{what}: observed {got}, afresh {want}")
            raise StaleObservation(self.stale[-1])


@pytest.fixture
def checked_observation(monkeypatch) -> Checked:
    """Every observation any ``ImplTarget`` makes is compared with one made
    afresh at the same instant."""
    checked = Checked()
    calls, assert_same = checked.calls, checked.assert_same
    observe, observe_request = ImplTarget.observe, ImplTarget.observe_request
    final_view = ImplTarget.final_view

    def checked_observe(self):
        obs = observe(self)
        fresh = observe_afresh(self)
        for rid in fresh.requests.keys() | obs.requests.keys():
            assert_same(obs.requests.get(rid), fresh.requests.get(rid), f"request {rid}")
        assert_same(obs.pool, fresh.pool, "pool")
        assert_same(obs, fresh, "observation")
        calls["observe"] += 1
        return obs

    def checked_observe_request(self, request_id):
        view = observe_request(self, request_id)
        s = self.scheduler
        assert_same(view, _view_afresh(s.requests[request_id], s.kv.get_blocks(request_id)),
                    f"request {request_id}")
        calls["observe_request"] += 1
        return view

    def checked_final_view(self, request_id):
        view = final_view(self, request_id)
        r = self._requests.get(request_id)
        if view is not None:
            assert_same(view, _view_afresh(r, [[] for _ in self.config.groups]),
                        f"final {request_id}")
            calls["final_view"] += 1
        return view

    monkeypatch.setattr(ImplTarget, "observe", checked_observe)
    monkeypatch.setattr(ImplTarget, "observe_request", checked_observe_request)
    monkeypatch.setattr(ImplTarget, "final_view", checked_final_view)
    return checked


#: the reference, and mutants that write what is observed: a preempted
#: request's blocks kept (counts, free queue), its stats written again
#: (a request field), drafts cut and placeholders kept (request lists)
OBSERVED = ["impl", "mutant:preempt_keeps_blocks", "mutant:stats_reset_on_reschedule",
            "mutant:draft_count_ignores_placeholders"]


@pytest.mark.parametrize("target", OBSERVED)
def test_every_observation_equals_one_made_afresh(target, checked_observation):
    """Random runs (async scheduling, loads and failures, hybrid groups,
    drafts, resets, aborts): every observation compared whole; a mutant's
    counterexample ends its run quietly, the runs go on."""
    assert target == "impl" or target[len("mutant:"):] in MUTANTS
    machine = machine_for(target, on_counterexample=lambda exc: True)
    run_machine(machine, 30, 40, 30, phases=(Phase.generate,))
    assert not checked_observation.stale, checked_observation.stale[:3]
    calls = checked_observation.calls
    assert machine.stats["actions"] > 200, machine.stats
    assert calls["observe"] > 400 and calls["final_view"] > 0, calls


class MeddlingScheduler(Scheduler):
    """After each call, writes what is observed directly, as a buggy scheduler
    could: counts, the free queue's order, and request lists in place with
    their lengths kept (what comparing lengths or identities would miss)."""

    rng = random.Random(0)

    def schedule(self):
        out = super().schedule()
        self.meddle()
        return out

    def update_from_output(self, scheduler_output, model_output):
        super().update_from_output(scheduler_output, model_output)
        self.meddle()

    def meddle(self) -> None:
        rng, pool = self.rng, self.kv.pool
        for _ in range(rng.randint(0, 3)):
            kind = rng.randrange(6)
            block = rng.choice(pool.blocks)
            requests = list(self.requests.values())
            r = rng.choice(requests) if requests else None
            if kind == 0:  # a count one too high: a block leaks, none is freed twice
                block.ref_cnt += 1
            elif kind == 1 and len(pool.free_queue) > 1:  # the oldest free block goes last
                pool.free_queue.append(pool.free_queue.popleft())
            elif kind == 2 and r is not None:
                prompt = list(r.prompt_token_ids)  # (the reference's prompt is a tuple)
                prompt[rng.randrange(len(prompt))] += 1
                r.prompt_token_ids = type(r.prompt_token_ids)(prompt)
            elif kind == 3 and r is not None and r.output_token_ids:
                r.output_token_ids[-1] += 1
            elif kind == 4 and r is not None:
                table = self.kv.get_blocks(r.request_id)[0]
                if len(table) > 1:  # two blocks of a table swapped in place
                    table[0], table[-1] = table[-1], table[0]
            elif kind == 5 and r is not None and r.block_hashes:
                r.block_hashes[0] = rng.random()


def _drive(target: ImplTarget, rng: random.Random, steps: int) -> None:
    """Adds, steps and aborts at random, observing after every call."""
    for _ in range(steps):
        op = rng.random()
        if op < 0.3:
            rid = f"r{len(target._requests)}"
            target.add_request(RequestSpec(rid, tuple(rng.randint(1, 9) for _ in
                                                      range(rng.randint(1, 12))), 6))
        elif op < 0.35 and target.scheduler.requests:
            target.abort(rng.choice(sorted(target.scheduler.requests)))
        else:
            step = target.schedule()
            target.observe()
            target.update_from_output(WorkerOutcome(sampled_token_ids={
                rid: (rng.randint(1, 9),) for rid in step.num_scheduled_tokens}))
        target.observe()


@pytest.mark.parametrize("seed", range(4))
def test_writes_behind_the_schedulers_back_are_observed(seed, checked_observation):
    config = make_config(block_size=2, num_blocks=24, max_num_batched_tokens=16,
                         max_num_seqs=4, max_model_len=24)
    target = ImplTarget(config, None, scheduler_factory=MeddlingScheduler)
    try:
        _drive(target, random.Random(seed), 120)
    except AssertionError as exc:  # the scheduler's own asserts, broken by the meddling
        if "block pool" not in str(exc):
            raise
    assert not checked_observation.stale, checked_observation.stale[:3]
    assert checked_observation.calls["observe"] > 50


def test_what_did_not_change_is_the_same_object():
    """Two observations with nothing in between share every view and every
    pool tuple; a changed request gets a new view, the others keep theirs."""
    config = make_config(block_size=2, num_blocks=24, max_num_batched_tokens=16,
                         max_num_seqs=4, max_model_len=24)
    target = ImplTarget(config, None)
    rng = random.Random(1)
    _drive(target, rng, 20)
    target.add_request(RequestSpec("late", (1, 2, 3), 4))
    first, second = target.observe(), target.observe()
    assert first.requests and all(second.requests[rid] is v for rid, v in first.requests.items())
    for name in ("ref_cnt", "free_queue", "cached", "fenced"):
        assert getattr(second.pool, name) is getattr(first.pool, name), name
    late = target.scheduler.requests["late"]
    late.num_computed_tokens += 1
    third = target.observe()
    assert third.requests["late"] is not second.requests["late"]
    assert third.requests["late"].prompt_token_ids is second.requests["late"].prompt_token_ids
    assert all(third.requests[rid] is v for rid, v in second.requests.items() if rid != "late")


def test_a_copied_target_observes_its_own_state(checked_observation):
    """A deep copy (bounded model checking copies runners) and its original go
    on apart, each observed exactly: what one remembers is not the other's."""
    config = make_config(block_size=2, num_blocks=24, max_num_batched_tokens=16,
                         max_num_seqs=4, max_model_len=24)
    target = ImplTarget(config, None)
    _drive(target, random.Random(2), 30)
    twin = copy.deepcopy(target)
    _drive(target, random.Random(3), 30)
    _drive(twin, random.Random(4), 30)
    assert target.observe() != twin.observe()
    assert not checked_observation.stale


def test_departed_requests_are_forgotten():
    config = make_config(block_size=2, num_blocks=24, max_num_batched_tokens=16,
                         max_num_seqs=4, max_model_len=24)
    target = ImplTarget(config, None)
    _drive(target, random.Random(5), 60)
    target.observe()
    assert set(target._seen) == set(target.scheduler.requests)
    assert any(r.status == RequestStatus.FINISHED_ABORTED or r.status.is_finished
               for rid, r in target._requests.items() if rid not in target.scheduler.requests)


# -- the vLLM observer --------------------------------------------------------

def _vllm_view_afresh(observer, r, tables) -> RequestView:
    """A vLLM request's view with every field copied and translated anew."""
    status = observer._status(r)
    cached, external = observer._stats_of(r, status)
    return RequestView(
        request_id=r.request_id, status=status, prompt_token_ids=tuple(r.prompt_token_ids),
        output_token_ids=tuple(r.output_token_ids), max_tokens=r.max_tokens,
        num_computed_tokens=r.num_computed_tokens, num_cached_tokens=cached,
        num_external_computed_tokens=external,
        num_preemptions=getattr(r, "num_preemptions", 0),
        block_ids=tuple(observer._to_spec_ids(list(t), g) for g, t in enumerate(tables)),
        block_hashes=tuple(r.block_hashes), spec_token_ids=tuple(r.spec_token_ids),
        num_output_placeholders=getattr(r, "num_output_placeholders", 0), priority=r.priority,
        **observer._stop_rules(r))


def _vllm_cached_afresh(observer) -> tuple:
    from kvspec.harness.vllm_observe import NULL_BLOCKS
    from kvspec.spec.groups import get_group_cache_key
    m, table = observer.m, observer.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    cached = []
    for key, value in getattr(table, "_cache", table).items():
        spec_key = get_group_cache_key(m.get_block_hash(key) if m.get_block_hash else key,
                                       m.get_group_id(key) if m.get_group_id else 0)
        for block in (value.values() if isinstance(value, dict) else [value]):
            cached.append((spec_key, block.block_id - NULL_BLOCKS))
    return tuple(cached)


@pytest.fixture
def checked_vllm_observation(monkeypatch) -> Checked:
    """Every observation a vLLM observer makes is compared with one made afresh:
    each view, the counts and free queue, and the prefix cache translated anew."""
    pytest.importorskip("vllm")
    from kvspec.harness.vllm_observe import NULL_BLOCKS, VllmObserver
    checked = Checked()
    observe, observe_request = VllmObserver.observe, VllmObserver.observe_request

    def checked_observe(self):
        obs = observe(self)
        s = self.scheduler
        for rid in s.requests.keys() | obs.requests.keys():
            checked.assert_same(obs.requests.get(rid), _vllm_view_afresh(
                self, s.requests[rid], s.kv_cache_manager.get_block_ids(rid)), f"request {rid}")
        pool = s.kv_cache_manager.block_pool
        checked.assert_same(obs.pool.ref_cnt, tuple(b.ref_cnt for b in pool.blocks[NULL_BLOCKS:]),
                            "ref_cnt")
        checked.assert_same(obs.pool.free_queue, tuple(
            b.block_id - NULL_BLOCKS for b in pool.free_block_queue.get_all_free_blocks()),
            "free_queue")
        checked.assert_same(obs.pool.cached, _vllm_cached_afresh(self), "cached")
        checked.calls["observe"] += 1
        return obs

    def checked_observe_request(self, request_id):
        view = observe_request(self, request_id)
        s = self.scheduler
        checked.assert_same(view, _vllm_view_afresh(
            self, s.requests[request_id], s.kv_cache_manager.get_block_ids(request_id)),
            f"request {request_id}")
        checked.calls["observe_request"] += 1
        return view

    monkeypatch.setattr(VllmObserver, "observe", checked_observe)
    monkeypatch.setattr(VllmObserver, "observe_request", checked_observe_request)
    return checked


@pytest.mark.parametrize("target", ["vllm", "vllm?plant=preempt-keeps-computed-tokens"])
def test_every_vllm_observation_equals_one_made_afresh(target, checked_vllm_observation):
    """Random runs of vLLM's scheduler (and of one with a planted bug): every
    observation compared whole."""
    machine = machine_for(target, on_counterexample=lambda exc: True)
    run_machine(machine, 30, 8, 30, phases=(Phase.generate,))
    checked = checked_vllm_observation
    assert not checked.stale, checked.stale[:3]
    assert machine.stats["actions"] > 50 and checked.calls["observe"] > 50, checked.calls


def test_the_vllm_cache_key_memo_stays_bounded():
    """Translated prefix-cache keys are remembered, but not every key ever
    cached: a long run evicts and caches new keys without end."""
    from types import SimpleNamespace
    from kvspec.harness.vllm_observe import VllmObserver
    from kvspec.spec.groups import get_group_cache_key
    observer = SimpleNamespace(_cache_keys={},
                               m=SimpleNamespace(get_block_hash=None, get_group_id=None))
    for start in range(0, 60_000, 500):
        keys = [f"k{i}" for i in range(start, start + 500)]
        assert VllmObserver._get_spec_keys(observer, keys) == \
            [get_group_cache_key(k, 0) for k in keys]
        assert len(observer._cache_keys) <= 2 * 500 + 1024 + 500
