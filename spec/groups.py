"""KV cache groups: what a step reads in each kind of group, what a group may
free, and which computed prefix a group can serve.

Hybrid models (Gemma 3, gpt-oss, Qwen3-Next, Jamba) give each kind of layer
its own KV cache group with its own block table over one block pool (vLLM's
hybrid KV cache manager). Every group's table covers the same positions, block
``i`` holding positions ``[i * block_size, (i + 1) * block_size)`` with the
group's own block size (full attention and sliding window may differ: a prefix
hit then ends where every group's blocks end, ``Config.scheduler_block_size``); a group
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


#: a prefix-cache key of group ``g > 0`` is ``(GROUP_KEY, g, block_hash)``; group 0's is the hash
GROUP_KEY = "group"


def get_group_cache_key(block_hash, group_index: int):
    """The prefix cache keys a block by its content's hash and its group (a
    sliding-window block and a full-attention block of one prefix hold
    different KV). Group 0 keeps the plain hash."""
    return block_hash if group_index == 0 else (GROUP_KEY, group_index, block_hash)


def is_group_cache_key(key) -> bool:
    """``key`` has the shape of a group's prefix-cache key (``get_group_cache_key``)."""
    return isinstance(key, tuple) and len(key) == 3 and key[0] == GROUP_KEY


def split_cache_key(key) -> tuple[object, int]:
    """``(block_hash, group_index)`` of a prefix-cache key."""
    if is_group_cache_key(key):
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


def get_first_failed_position(groups, tables, num_computed: int, bad) -> int | None:
    """First position, in any group, of a block under a request's computed
    prefix that is in ``bad``: the start of that block (groups share positions,
    though their blocks may differ in size)."""
    found = [i * group.block_size for group, table in zip(groups, tables)
             for i, b in enumerate(table[:-(-num_computed // group.block_size)]) if b in bad]
    return min(found, default=None)


def get_blocks_from(groups, tables, pos: int) -> set[int]:
    """The blocks of every group holding a position at or past ``pos``."""
    return {b for group, table in zip(groups, tables)
            for b in table[pos // group.block_size:] if b != NULL_BLOCK}


def compute_tainted_blocks(holders, groups, bad) -> set[int]:
    """Blocks that count as failed after a failed load with several groups:
    the failed ones, and, to a fixed point, every block a holder of one keeps
    at or past its first failed position, in every group. ``holders``: (block
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
            first = get_first_failed_position(groups, tables, num_computed, tainted)
            if first is not None:
                tainted |= get_blocks_from(groups, tables, first)
        if len(tainted) == before:
            return tainted


def get_block_hash_index(group: GroupSpec, index: int, hash_block_size: int) -> int:
    """Which of a request's block hashes (one per ``hash_block_size`` tokens)
    names block ``index`` of ``group``: the last hash inside it. Hashes chain
    over the whole prefix, so that one names the block's content and all before
    it (vLLM's ``BlockHashListWithBlockSize``)."""
    return (index + 1) * (group.block_size // hash_block_size) - 1


def get_num_hashed_blocks(group: GroupSpec, num_hashes: int, hash_block_size: int) -> int:
    """How many of ``group``'s blocks ``num_hashes`` block hashes name."""
    return num_hashes * hash_block_size // group.block_size


def is_block_reachable(group: GroupSpec, index: int, alignment: int) -> bool:
    """Some prefix hit reads block ``index`` of ``group``; hits end on
    multiples of ``alignment`` (the scheduler block size). Full attention reads
    every block; a windowed group only those in the window of a hit's end, and
    the first end at or past the block's is its only chance (later ones read
    later blocks). A block no hit reads is not worth caching: with one block
    size every block of a window of 2 or more is reachable; with a larger
    scheduler block, only the tail of each (vLLM's ``reachable_block_mask``)."""
    end = (index + 1) * group.block_size
    hit_end = -(-end // alignment) * alignment
    return index in get_needed_blocks(group, hit_end)

