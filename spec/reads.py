"""What a step reads: per kind of KV cache group, the positions a step starting
at ``num_computed`` attends to, written out here for the checkers.

The reference scheduler frees and allocates with ``spec/groups.py``'s block
arithmetic (``compute_read_start``, ``compute_num_skipped_blocks``,
``get_needed_blocks``). The claims that judge it (``every_group_serves_computed``,
the data oracle's reads, the Z3 recovery lemma) read this second description
instead, so a wrong window start in that arithmetic shows as a claim failing, not
as a claim agreeing with the code it checks (issue 25). Written with the
``logic`` helpers: the same functions judge plain ints and Z3 terms.
"""
from __future__ import annotations

from kvspec.spec.logic import And


def get_first_read(group, num_computed):
    """The first position the step reads, before clipping at 0: a sliding window
    of ``w`` tokens attends to the token it computes and the ``w - 1`` before it;
    a last-state group reads the state after the last computed token; full
    attention reads every computed token."""
    if group.kind == "sliding_window":
        return num_computed - (group.sliding_window - 1)
    if group.kind == "last_state":
        return num_computed - 1
    return 0


def is_read_by_step(group, num_computed, p):
    """A step from ``num_computed`` reads position ``p`` in ``group``."""
    return And(p >= 0, p >= get_first_read(group, num_computed), p < num_computed)


def get_positions_read(group, num_computed: int) -> range:
    """The positions a step from ``num_computed`` reads (plain ints)."""
    return range(max(0, get_first_read(group, num_computed)), num_computed)


def get_blocks_read(group, num_computed: int) -> list[int]:
    """Indices of the blocks that hold a position the step reads (plain ints)."""
    size = group.block_size
    read = get_positions_read(group, num_computed)
    # ``sorted({p // size for p in read})``: the blocks from the first read to the last
    return list(range(read.start // size, (read.stop - 1) // size + 1)) if read else []
