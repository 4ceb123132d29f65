"""KV cache groups: what a step reads in each kind of group, what a group may
free, and which computed prefix a group can serve.

Hybrid models (Gemma 3, gpt-oss, Qwen3-Next, Jamba) give each kind of layer
its own KV cache group with its own block table over one block pool (vLLM's
hybrid KV cache manager). Every group's table covers the same positions, block
``i`` holding positions ``[i * block_size, (i + 1) * block_size)``; a group
that no longer needs a block gives it back and its table holds ``NULL_BLOCK``
there (vLLM's null block).

What a step that starts at ``num_computed_tokens = n`` reads, per kind:

- **full attention**: every earlier position, ``[0, n)``;
- **sliding window** of ``w`` tokens: the last ``w - 1`` positions, ``[n - w + 1, n)``
  (the token at ``n`` attends to itself and the ``w - 1`` before it);
- **last state** (Mamba-like): the state after ``n`` tokens, which the worker
  keeps at position ``n - 1``: ``[n - 1, n)``.

Everything before the read start is never read again (positions only grow), so
a group may free those blocks. The functions are written with ``spec.logic``'s
connectives: the group is concrete, the positions may be Z3 terms.
"""
from __future__ import annotations

from kvspec.spec.logic import And, If, Max, Or, fdiv
from kvspec.spec.state import GroupSpec

#: a table entry a group gave back (vLLM's null block): never read, never held
NULL_BLOCK = -1


def is_windowed(group: GroupSpec) -> bool:
    """The group frees blocks behind its read window (not full attention)."""
    return group.kind != "full_attention"


def compute_read_start(group: GroupSpec, num_computed):
    """First position a step starting at ``num_computed`` reads in this group."""
    if group.kind == "sliding_window":
        return Max(0, num_computed - group.sliding_window + 1)
    if group.kind == "last_state":
        return Max(0, num_computed - 1)
    return 0


def compute_num_skipped_blocks(group: GroupSpec, num_computed):
    """Leading blocks no step from ``num_computed`` on reads: the group may free them."""
    return fdiv(compute_read_start(group, num_computed), group.block_size)


def is_served(group: GroupSpec, num_computed, first_present, first_invalid):
    """The group can serve a prefix of ``num_computed`` tokens when what a step
    from there reads lies in ``[first_present, first_invalid)``: the positions
    it holds valid content for. An empty prefix needs nothing."""
    return Or(num_computed == 0,
              And(compute_read_start(group, num_computed) >= first_present,
                  num_computed <= first_invalid))


def compute_recovered_computed(groups, cut, first_present, first_invalid):
    """``num_computed_tokens`` after a failed load, across groups: the cut at
    the first failed block if every group can serve it, else zero (a group that
    cannot roll back to the cut recomputes from the start, seed 003 / #35223).
    ``first_present`` and ``first_invalid``: per group, as for ``is_served``."""
    ok = And(*[is_served(g, cut, p, f) for g, p, f in zip(groups, first_present, first_invalid)])
    return If(ok, cut, 0)


def get_group_cache_key(block_hash, group_index: int):
    """The prefix cache keys a block by its content's hash and its group (a
    sliding-window block and a full-attention block of one prefix hold
    different KV). Group 0 keeps the plain hash."""
    return block_hash if group_index == 0 else ("group", group_index, block_hash)


def split_cache_key(key) -> tuple[object, int]:
    """``(block_hash, group_index)`` of a prefix-cache key."""
    if isinstance(key, tuple) and len(key) == 3 and key[0] == "group":
        return key[2], key[1]
    return key, 0


def get_read_positions(group: GroupSpec, num_computed: int) -> range:
    """The positions a step starting at ``num_computed`` reads in this group."""
    return range(compute_read_start(group, num_computed), num_computed)


def get_needed_blocks(group: GroupSpec, num_computed: int) -> range:
    """Indices of the blocks a step starting at ``num_computed`` reads: those
    holding a position it reads (none for a window of one token, which reads
    only the position it computes)."""
    positions = get_read_positions(group, num_computed)
    if not positions:
        return range(0)
    size = group.block_size
    return range(positions[0] // size, -(-num_computed // size))


def get_first_failed_index(tables, num_computed: int, block_size: int, bad) -> int | None:
    """Index of a request's first block, in any group, under its computed
    prefix that is in ``bad`` (groups share positions: every group's table is
    cut there)."""
    limit = -(-num_computed // block_size)
    found = [i for table in tables for i, b in enumerate(table[:limit]) if b in bad]
    return min(found, default=None)


def compute_tainted_blocks(holders, block_size: int, bad) -> set[int]:
    """Blocks that count as failed after a failed load with several groups:
    the failed ones, and, to a fixed point, every block a holder of one keeps
    at or past its first failed index, in every group. ``holders``: (block
    tables, real computed count) per request.

    Conservative on purpose: a layer reads the layer before it, so what a
    request computed past a failed block in one group may be wrong in every
    group, and a request that shares such a block (a hit) read it. The spec
    does not model which layer reads which position, so it counts all of it
    as failed: the cost of the over-approximation is a recompute, never a
    wrong token."""
    tainted = set(bad)
    while True:
        before = len(tainted)
        for tables, num_computed in holders:
            first = get_first_failed_index(tables, num_computed, block_size, tainted)
            if first is not None:
                tainted.update(b for t in tables for b in t[first:] if b != NULL_BLOCK)
        if len(tainted) == before:
            return tainted
