"""What the worker knows of the block tables: only what the scheduler output
tells it, as vLLM's model runner builds ``InputBatch.block_table``. A new
request brings its whole table, a resumed one (after a preemption) replaces
its table, any other appends the blocks allocated since its last step; a
preempted or finished request leaves the batch.

The claim ``worker_tables_match_scheduler`` compares these tables with the
scheduler's own (the KV cache manager's) wherever the step reads or writes:
where they differ the model computes on KV the scheduler did not give it
(#26661: a resumed request's table not reset; #26385).
"""
from __future__ import annotations

from kvspec.spec.logic import cdiv
from kvspec.spec.reads import get_blocks_read

Tables = dict[str, tuple[tuple[int, ...], ...]]


def apply_scheduler_output(tables: Tables, step, live) -> Tables:
    """The worker's tables after it reads ``step`` (a StepView); ``live``: the
    ids the scheduler still holds. A target that sends no block ids leaves them
    as they were."""
    if not step.new_block_ids:
        return tables
    whole = set(step.new_req_ids) | set(step.resumed_req_ids)
    after = {rid: t for rid, t in tables.items()
             if rid in live and rid not in step.preempted_req_ids}
    for rid, blocks in step.new_block_ids.items():
        if rid in whole:
            after[rid] = tuple(tuple(g) for g in blocks or ())
        elif blocks is not None:
            held = after.get(rid, tuple(() for _ in blocks))
            after[rid] = tuple(tuple(h) + tuple(b) for h, b in zip(held, blocks))
    return after


def get_step_blocks(group, start: int, num_new: int) -> list[int]:
    """Indices of the blocks a step from ``start`` computing ``num_new`` tokens
    reads or writes in ``group``."""
    written = range(start // group.block_size, cdiv(start + num_new, group.block_size))
    read = get_blocks_read(group, start)
    if not read or not written:
        return read or list(written)
    # both runs of indices, touching: the last read holds position start - 1
    return list(range(min(read[0], written.start), max(read[-1] + 1, written.stop)))
