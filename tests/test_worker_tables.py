"""The worker's block tables, built from the scheduler outputs alone
(spec/worker.py), and the claim that compares them with the scheduler's
(worker_tables_match_scheduler, issue 25 part 4, #26661)."""
from __future__ import annotations

from kvspec.spec.state import GroupSpec, StepView
from kvspec.spec.worker import apply_scheduler_output, get_step_blocks


def step(new=(), resumed=(), preempted=(), told=None) -> StepView:
    told = told or {}
    return StepView(num_scheduled_tokens={rid: 1 for rid in told},
                    num_computed_before={rid: 0 for rid in told},
                    scheduled_spec_decode_tokens={}, new_req_ids=tuple(new),
                    resumed_req_ids=tuple(resumed), preempted_req_ids=frozenset(preempted),
                    new_block_ids=told)


def test_a_new_request_brings_its_table_and_a_running_one_appends():
    tables = apply_scheduler_output({}, step(new=["r0"], told={"r0": ((4, 5),)}), {"r0"})
    assert tables == {"r0": ((4, 5),)}
    tables = apply_scheduler_output(tables, step(told={"r0": ((7,),)}), {"r0"})
    assert tables == {"r0": ((4, 5, 7),)}
    tables = apply_scheduler_output(tables, step(told={"r0": None}), {"r0"})
    assert tables == {"r0": ((4, 5, 7),)}


def test_a_resumed_request_replaces_its_table_and_a_preempted_one_leaves():
    tables = {"r0": ((4, 5, 7),), "r1": ((1,),)}
    tables = apply_scheduler_output(tables, step(preempted=["r1"], told={"r0": None}),
                                    {"r0", "r1"})
    assert tables == {"r0": ((4, 5, 7),)}
    tables = apply_scheduler_output(tables, step(resumed=["r0"], told={"r0": ((2,),)}), {"r0"})
    assert tables == {"r0": ((2,),)}
    assert apply_scheduler_output(tables, step(told={}), set()) == tables  # no block ids sent


def test_the_blocks_a_step_touches_are_its_window_and_what_it_writes():
    full = GroupSpec(2)
    window = GroupSpec(2, "sliding_window", sliding_window=3)
    assert get_step_blocks(full, 4, 3) == [0, 1, 2, 3]
    assert get_step_blocks(window, 8, 1) == [3, 4]  # reads 6 and 7, writes 8


def test_the_blocks_a_step_touches_are_one_run_of_indices():
    """``get_step_blocks`` builds one range; its definition is the union of
    the blocks read and the blocks written, over every group shape."""
    from kvspec.spec.logic import cdiv
    from kvspec.spec.reads import get_blocks_read
    groups = [GroupSpec(size) for size in (1, 2, 4, 16)] + \
        [GroupSpec(size, "sliding_window", sliding_window=w) for size in (1, 2, 4)
         for w in (1, 3, 4, 9)] + [GroupSpec(4, "last_state")]
    for group in groups:
        for start in range(0, 40):
            for num_new in range(0, 20):
                written = range(start // group.block_size, cdiv(start + num_new, group.block_size))
                want = sorted(set(get_blocks_read(group, start)) | set(written))
                assert get_step_blocks(group, start, num_new) == want, (group, start, num_new)


def test_the_data_oracle_alone_sees_a_table_the_worker_was_told_wrong(tmp_path):
    """The worker computes on the tables the scheduler outputs built (issue 25,
    part 4): with every claim but the data oracle's switched off, the #26661
    shape (a resumed request's table not reset) is caught, because its KV is
    written where the output said, not where the scheduler counts it."""
    from kvspec.harness.fuzz import fuzz
    result = fuzz("mutant:resumed_table_not_reset", budget=15, seed=0, out_dir=tmp_path,
                  kinds=("data",))
    assert result.counterexample is not None
    # (garbage counted as computed, or cached: which one a shrink ends on varies)
    assert {v.invariant for v in result.counterexample.violations} & {
        "computed_means_valid", "no_caching_of_invalid_blocks"}
