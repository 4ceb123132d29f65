"""Incremental checks are not weaker than full ones (issue 30).

A check judges only the requests and blocks a call may have changed
(``kvspec/harness/incremental.py``), and everything at an interval and at the
end of a run. Held to the full check three ways: state broken between two
full checks is reported at the step that broke it; every incremental check of
random runs, on the reference and on mutants, is judged whole too and must
find exactly the same (``KVSPEC_SHADOW_CHECKS``); and each committed
counterexample fails at the same step with the same claims either way."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import Phase

from kvspec.harness.checker import IncrementalGap
from kvspec.harness.incremental import Incremental
from kvspec.harness.machine import machine_for
from kvspec.harness.replay import load_trace
from kvspec.harness.runner import Counterexample, Runner
from kvspec.harness.target import make_config
from kvspec.impl.mutants import MUTANTS
from kvspec.spec.oracle import GARBAGE

from random_runs import run_machine

NEVER_FULL = 10 ** 9
REGRESSIONS = sorted((Path(__file__).parents[1] / "model_tests" / "regressions").glob("*.json"))


def _warm_runner(full_every: int = NEVER_FULL) -> Runner:
    """Four requests sharing a prefix, six steps in; no full check since the first."""
    runner = Runner("impl", make_config(block_size=4, num_blocks=40, max_num_batched_tokens=64,
                                        max_num_seqs=4, max_model_len=40),
                    full_every=full_every)
    for i in range(4):
        runner.apply({"op": "add", "id": f"r{i}", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, i],
                      "max_tokens": 20})
    for _ in range(6):
        runner.apply({"op": "step"})
    return runner


def _caught_at_next_step(runner: Runner) -> set[str]:
    checks = runner.checker.incremental.full_checks
    with pytest.raises(Counterexample) as exc:
        runner.apply({"op": "step"})
    assert runner.checker.incremental.full_checks == checks, "a full check ran: not incremental"
    return {v.invariant for v in exc.value.violations}


def test_state_broken_between_two_steps_is_caught_at_the_next():
    """What the checks derive once (per Context, or once per hash) hides no
    change: a reference count, a computed count or a cached block's content
    broken after many checked steps is reported at the very next step."""
    runner = _warm_runner()
    block = next(b for b in runner.target.scheduler.kv.pool.blocks if b.ref_cnt >= 1)
    block.ref_cnt += 1
    assert "ref_count_is_holders" in _caught_at_next_step(runner)

    runner = _warm_runner()
    request = runner.target.scheduler.requests["r1"]
    request.num_computed_tokens -= 2
    assert {"schedule_relation", "transition_admitted_by_model"} <= _caught_at_next_step(runner)

    runner = _warm_runner()
    cached = {b for _k, b in runner.obs.pool.cached}
    held = {b for r in runner.obs.requests.values() for b in r.block_ids[0]}
    victim = min(cached - held) if cached - held else min(cached)
    runner.content._write(0, (victim,), 0, GARBAGE)  # the worker's KV there is lost
    assert "no_caching_of_invalid_blocks" in _caught_at_next_step(runner)


def test_the_warm_run_checks_incrementally():
    runner = _warm_runner()
    inc = runner.checker.incremental
    assert inc.checks == 16 and inc.full_checks == 2  # the first check of each mode


@pytest.mark.parametrize("breach, claim", [
    ("ref_count", "ref_count_is_holders"),
    ("free_queue", "free_queue_is_free_blocks"),
    ("cached_content", "no_caching_of_invalid_blocks"),
    ("held_content", "computed_means_valid"),
    ("stats", "stats_set_exactly_once"),
    ("queue", "queues_match_status"),
])
def test_state_broken_between_full_checks_is_caught_at_that_step(breach, claim):
    """Each kind of change an incremental check must see, made behind the
    scheduler's back on a block or request the next step does not touch."""
    runner = _warm_runner()
    scheduler, pool = runner.target.scheduler, runner.target.scheduler.kv.pool
    held = {b for r in runner.obs.requests.values() for t in r.block_ids for b in t}
    cached = {b for _k, b in runner.obs.pool.cached}
    if breach == "ref_count":
        block = next(b for b in pool.blocks if b.ref_cnt == 0 and b.block_id not in held)
        block.ref_cnt += 1  # a free block counted as held
    elif breach == "free_queue":
        free = list(pool.free_queue)
        pool.free_queue.remove(free[-1])  # a free block lost from the queue
    elif breach == "cached_content":  # the worker model loses a cached block's KV
        runner.content._write(0, (min(cached - held) if cached - held else min(cached),), 0,
                              GARBAGE)
    elif breach == "held_content":  # the worker model loses r0's first block
        runner.content._write(0, runner.obs.requests["r0"].block_ids[0], 0, GARBAGE)
    elif breach == "stats":
        scheduler.requests["r2"].num_cached_tokens += 1
    elif breach == "queue":
        scheduler.running.append(scheduler.requests["r3"])
    assert claim in _caught_at_next_step(runner)


def test_a_change_no_log_records_is_found_by_the_next_full_check():
    """The interval is the backstop: content overwritten with no log entry, on
    a block no request holds and the cache does not name, is not in any scope;
    a full check finds nothing wrong there either, while a cached block so
    overwritten unlogged is found at the next full check."""
    runner = _warm_runner(full_every=4)
    cached = {b for _k, b in runner.obs.pool.cached}
    held = {b for r in runner.obs.requests.values() for t in r.block_ids for b in t}
    victim = min(cached - held) if cached - held else min(cached)
    runner.content.slots[victim][0] = GARBAGE
    with pytest.raises(Counterexample) as exc:
        for _ in range(8):
            runner.apply({"op": "step"})
    assert "no_caching_of_invalid_blocks" in {v.invariant for v in exc.value.violations}


def test_the_end_of_a_run_is_judged_whole():
    """``Runner.finish`` (``run``'s last act, and the healed phase's) judges the
    last state whole: what held narrowed holds whole, and a change no log
    recorded is found there."""
    runner = _warm_runner()
    assert runner.checker.last_checked.scope is not None
    runner.finish()  # silent
    runner = _warm_runner()
    cached = {b for _k, b in runner.obs.pool.cached}
    runner.content.slots[min(cached)][0] = GARBAGE  # not logged: no scope covers it
    with pytest.raises(Counterexample) as exc:
        runner.finish()
    assert "no_caching_of_invalid_blocks" in {v.invariant for v in exc.value.violations}
    # the last action's line in the step log says so
    assert any(v.invariant == "no_caching_of_invalid_blocks" for v in runner.log[-1].violations)


def test_full_every_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        Incremental(0)


SHADOWED = ["impl", *(f"mutant:{name}" for name in MUTANTS)]


@pytest.mark.parametrize("target", SHADOWED)
def test_incremental_checks_find_exactly_what_full_checks_find(target, monkeypatch):
    """Random runs (every feature the machine draws: async scheduling, loads
    and failures, hybrid groups, drafts, resets), each incremental check also
    judged whole: any difference raises ``IncrementalGap``. A mutant's
    counterexample ends its run quietly; the runs go on."""
    monkeypatch.setenv("KVSPEC_SHADOW_CHECKS", "1")
    checks = Counter()

    class Machine(machine_for(target, on_counterexample=lambda exc: True)):
        def teardown(self):
            super().teardown()
            if self.runner is not None:
                inc = self.runner.checker.incremental
                checks.update(incremental=inc.checks - inc.full_checks, full=inc.full_checks)

    machine = Machine
    try:
        run_machine(machine, 30, 40, 30, phases=(Phase.generate,))
    except IncrementalGap as gap:
        pytest.fail(f"{target}: {gap}")
    assert machine.stats["actions"] > 100, machine.stats
    assert checks["incremental"] > 2 * checks["full"], checks  # the shadow had work


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_each_counterexample_fails_at_the_same_step_either_way(path):
    data = load_trace(path)
    found = []
    for full_every in (1, NEVER_FULL):
        runner = Runner(data.get("target", "impl"), data["config"],
                        kv=data.get("kv", "symbolic"), full_every=full_every)
        failure = runner.run(data["actions"])
        broke = failure or (runner.lost[0] if runner.lost else None)
        assert broke is not None
        found.append((len(runner.actions), [(s.index, sorted(map(str, s.violations)))
                                            for s in runner.log if s.violations]))
    assert found[0] == found[1]


@pytest.mark.parametrize("seed", [1, 2, 4])
def test_a_remembered_valid_prefix_gives_the_first_invalid_position(seed):
    """``first_invalid`` with a request id skips a full-attention prefix it
    found valid before; on random histories of writes, table changes, token
    changes and reads through ``before``, it names the same position as
    reading every position."""
    import random

    from kvspec.spec.groups import NULL_BLOCK
    from kvspec.spec.oracle import KVContent, extend_prefix_keys, get_content
    from kvspec.spec.reads import get_positions_read
    from kvspec.spec.state import GroupSpec

    def reference(content, tables, keys, upto, before):
        for g, group in enumerate(content.groups):
            for pos in get_positions_read(group, upto):
                table = tables[g] if g < len(tables) else ()
                if not content._is_valid(table, g, keys, pos, before):
                    return pos
        return None

    rng = random.Random(seed)
    skipped = 0
    for groups in [(GroupSpec(4),), (GroupSpec(2), GroupSpec(4, "sliding_window", 3)),
                   (GroupSpec(4), GroupSpec(4))]:
        content = KVContent(16, 4, groups)
        tokens = [rng.randint(0, 2) for _ in range(30)]
        tables = [[rng.randrange(1, 16) for _ in range(-(-40 // g.block_size))]
                  for g in groups]
        frontier = 0
        for _ in range(600):
            roll = rng.random()
            keys: list[int] = []
            extend_prefix_keys(keys, tokens, 0)
            if roll < 0.45:  # a step computes on from the frontier; sometimes a stray write
                pos = frontier if rng.random() < 0.8 else rng.randrange(len(keys))
                frontier = min(len(keys) - 1, frontier + 1) if rng.random() < 0.97 else 0
                for g in range(len(groups)):
                    value = get_content(g, keys, pos) if rng.random() < 0.95 else None
                    content._write(g, tables[g], pos, value)
            elif roll < 0.48:  # a block of the computed prefix replaced (a broken table)
                g = rng.randrange(len(groups))
                index = rng.randrange(frontier // groups[g].block_size + 1)
                tables[g][index] = rng.choice([NULL_BLOCK, rng.randrange(1, 16)])
            elif roll < 0.5:  # a known token changed
                tokens[rng.randrange(frontier + 1)] = rng.randint(0, 2)
            else:
                upto = rng.randint(0, frontier) if rng.random() < 0.8 else \
                    rng.randint(0, len(keys))
                before = None
                if rng.random() < 0.3:  # what the step found in a slot it writes itself
                    size = groups[0].block_size
                    index, slot = rng.randrange(len(tables[0])), rng.randrange(size)
                    valid = get_content(0, keys, min(index * size + slot, len(keys) - 1))
                    before = {(tables[0][index], slot): rng.choice([None, valid])}
                    if rng.random() < 0.5:  # while the slot itself holds garbage
                        content._write(0, tables[0], index * size + slot, None)
                frozen = tuple(tuple(t) for t in tables)
                want = reference(content, frozen, keys, upto, before)
                key = (frozen[0][:upto // groups[0].block_size], upto)
                got = content.first_invalid(frozen, keys, upto, before, request_id="r")
                skipped += content._get_valid_prefix("r", 0, frozen[0], keys, upto) > 0
                assert got == want, (groups, key, got, want)
                if before:  # what was read through ``before`` is not remembered as valid
                    assert content.first_invalid(frozen, keys, upto, request_id="r") == \
                        reference(content, frozen, keys, upto, None)
    assert skipped > 10  # the remembered prefix was used


def test_a_check_counts_its_incremental_and_full_state_checks(tmp_path):
    """``check --json`` says how many state checks judged only what changed."""
    from kvspec.harness.fuzz import fuzz
    result = fuzz("impl", budget=3, seed=1, out_dir=tmp_path, db_dir=tmp_path / "db")
    checks = result.state_checks
    assert checks["full"] > 0 and checks["incremental"] > 5 * checks["full"], checks


def test_changed_positions_are_where_the_tuples_differ():
    """``get_changed_positions`` (slices compared whole) against its definition,
    on lengths around the slice size and changes at its edges."""
    import random

    from kvspec.harness.incremental import CHUNK, get_changed_positions
    rng = random.Random(5)
    for n in (0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 10_000):
        old = tuple(rng.randint(0, 3) for _ in range(n))
        for k in (0, 1, 2, 40):
            new = list(old)
            edges = [i for i in (0, CHUNK - 1, CHUNK, n - 1) if 0 <= i < n]
            for i in edges[:k] + [rng.randrange(n) for _ in range(k)] if n else []:
                new[i] += 1
            want = [i for i in range(n) if old[i] != new[i]]
            assert get_changed_positions(old, tuple(new)) == want
