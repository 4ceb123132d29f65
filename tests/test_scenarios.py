"""Hand-written scenarios through the checking runner: each must pass on the
reference implementation, and each pins one behaviour of the KV path."""
import pytest

from kvspec.harness.runner import Counterexample, Runner
from kvspec.harness.target import make_config


def run(actions, **config):
    runner = Runner("impl", make_config(**config))
    for action in actions:
        runner.apply(action)
    return runner


def seed_example(target, prompt_len, ext, overclaim=False):
    runner = Runner(target, make_config(block_size=3, num_blocks=8))
    actions = [{"op": "add", "id": "r0", "prompt": list(range(1, prompt_len + 1)),
                "max_tokens": 2, "ext": ext, "async": True, "overclaim_ok": overclaim},
               {"op": "step"}, {"op": "step", "finish_loads": ["r0"]}, {"op": "drain"}]
    try:
        for action in actions:
            runner.apply(action)
    except Counterexample as exc:
        return [v.invariant for v in exc.violations]
    return []


@pytest.mark.parametrize("target", ["impl", "mutant:async_block_rounding"])
def test_seed_worked_example_case_1_three_external_tokens(target):
    # block size 3, prompt a b c d e, external a b c: both rules give 3.
    assert seed_example(target, 5, 3) == []


def test_seed_worked_example_case_2_is_a_contract_violation():
    # external a b c d e f: more than the prompt holds; the environment's fault.
    assert seed_example("impl", 5, 6, overclaim=True) == ["environment_contract"]


def test_seed_bug_external_hits_end_mid_block():
    # external a b c d of a b c d e f g: the old rule counts 6, only 4 arrived.
    assert seed_example("impl", 7, 4) == []
    assert seed_example("mutant:async_block_rounding", 7, 4)


def test_full_prompt_external_hit_recomputes_last_token():
    r = run([{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "ext": 5,
              "async": True},
             {"op": "step"}, {"op": "step", "finish_loads": ["r0"]}, {"op": "step"}],
            block_size=3, num_blocks=8)
    req = r.obs.requests["r0"]
    assert req.num_cached_tokens == 4 and req.num_external_computed_tokens == 4


def test_sync_load_failure_recovers_and_uncaches():
    r = run([{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 2,
              "ext": 6},
             {"op": "step", "fail": ["r0"], "fail_offset": 1}],
            block_size=2, num_blocks=10)
    req = r.obs.requests["r0"]
    assert req.num_computed_tokens == 2  # truncated at the failed block (index 1)
    assert req.output_token_ids == ()    # the step's output was discarded
    r.apply({"op": "drain"})
    assert not r.obs.requests


def test_delayed_free_holds_blocks_until_send_finishes():
    r = run([{"op": "add", "id": "r0", "prompt": [1, 2, 3], "max_tokens": 1, "send": True},
             {"op": "step"}], block_size=2, num_blocks=6)
    assert r.obs.requests["r0"].status.is_finished and any(r.obs.pool.ref_cnt)
    r.apply({"op": "step", "finish_sends": ["r0"]})
    assert not r.obs.requests and not any(r.obs.pool.ref_cnt)


def test_shared_failed_block_recomputed_by_one_request():
    prompt = [1, 2, 3, 4, 5, 6]
    r = run([{"op": "add", "id": "r0", "prompt": prompt + [7], "max_tokens": 3, "ext": 6},
             {"op": "add", "id": "r1", "prompt": prompt + [8], "max_tokens": 3},
             {"op": "step", "fail": ["r0"], "fail_offset": 1}],
            block_size=2, num_blocks=12, max_num_batched_tokens=32)
    owner, waiter = r.obs.requests["r0"], r.obs.requests["r1"]
    assert owner.num_computed_tokens == waiter.num_computed_tokens == 2
    r.apply({"op": "drain"})


def test_two_loaded_requests_holding_the_pool_do_not_deadlock():
    # Each async load holds 3 of 7 blocks and needs 5 to finish: without giving
    # loaded-but-waiting blocks back, neither could ever run.
    r = run([{"op": "add", "id": "r0", "prompt": [2, 4, 6, 10, 11, 12, 13, 14, 15],
              "max_tokens": 1, "ext": 5, "async": True},
             {"op": "add", "id": "r1", "prompt": [1, 2, 3, 17, 18, 19, 20, 21, 22],
              "max_tokens": 1, "ext": 5, "async": True},
             {"op": "step"}, {"op": "step", "finish_loads": ["r0", "r1"]}, {"op": "drain"}],
            block_size=2, num_blocks=7, max_model_len=12, max_num_batched_tokens=8)
    assert not r.obs.requests


def test_loaded_request_waiting_behind_a_runner_keeps_its_last_token():
    # The async full-prompt load finishes while the only seat is taken: the
    # waiting request must still leave its last token to compute.
    r = run([{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4], "max_tokens": 1, "ext": 4,
              "async": True},
             {"op": "add", "id": "r1", "prompt": [20, 21, 22, 23, 24, 25], "max_tokens": 4},
             {"op": "step"}, {"op": "step", "finish_loads": ["r0"]}, {"op": "step"}],
            block_size=2, num_blocks=12, max_num_seqs=1)
    r0 = r.obs.requests["r0"]
    assert r0.num_computed_tokens == 3 and r0.block_ids[0]


def test_two_token_prompt_fully_loaded_keeps_its_blocks_while_waiting():
    r = run([{"op": "add", "id": "r0", "prompt": [1, 2], "max_tokens": 1, "ext": 2,
              "async": True},
             {"op": "add", "id": "r1", "prompt": [20, 21, 22, 23, 24, 25], "max_tokens": 4},
             {"op": "step"}, {"op": "step", "finish_loads": ["r0"]}, {"op": "step"}],
            block_size=2, num_blocks=12, max_num_seqs=1)
    r0 = r.obs.requests["r0"]
    assert r0.num_computed_tokens == 1 and r0.block_ids[0]


def test_three_requests_share_a_failed_block_and_all_finish():
    prompt = [1, 2, 3, 4, 5, 6]
    r = run([{"op": "add", "id": "r0", "prompt": prompt + [7], "max_tokens": 3, "ext": 6},
             {"op": "add", "id": "r1", "prompt": prompt + [8], "max_tokens": 3},
             {"op": "add", "id": "r2", "prompt": prompt + [9], "max_tokens": 3},
             {"op": "step", "fail": ["r0"], "fail_offset": 0}, {"op": "drain"}],
            block_size=2, num_blocks=16, max_num_batched_tokens=32)
    assert not r.obs.requests


def test_waiters_take_over_when_the_owner_of_a_failed_block_leaves():
    # r0 owns the recompute of the failed shared block; it is aborted before
    # recomputing, so one of the waiters must take over, not wait for the other.
    prompt = [1, 2, 3, 4, 5, 6]
    r = run([{"op": "add", "id": "r0", "prompt": prompt + [7], "max_tokens": 3, "ext": 6},
             {"op": "add", "id": "r1", "prompt": prompt + [8], "max_tokens": 3},
             {"op": "add", "id": "r2", "prompt": prompt + [9], "max_tokens": 3},
             {"op": "step", "fail": ["r0"], "fail_offset": 0},
             {"op": "abort", "id": "r0"}, {"op": "drain"}],
            block_size=2, num_blocks=16, max_num_batched_tokens=32)
    assert not r.obs.requests


def test_waiter_does_not_resume_over_blocks_not_yet_recomputed():
    # Only the first block comes from the store and its load fails, so the next
    # blocks were computed on top of garbage. The owner recomputes one block per
    # step (chunked); the waiter may only move past blocks already rewritten.
    prompt = [1, 2, 3, 4, 5, 6]
    r = run([{"op": "add", "id": "r0", "prompt": prompt + [7], "max_tokens": 3, "ext": 2},
             {"op": "add", "id": "r1", "prompt": prompt + [8], "max_tokens": 3},
             {"op": "add", "id": "r2", "prompt": [30, 31], "max_tokens": 6},
             {"op": "step", "fail": ["r0"], "fail_offset": 0},
             {"op": "step"}, {"op": "step"}, {"op": "step"}, {"op": "drain"}],
            block_size=2, num_blocks=16, max_num_batched_tokens=32,
            long_prefill_token_threshold=2)
    assert not r.obs.requests


def test_async_load_failing_on_its_last_block_is_found():
    # Block size 3, four tokens loaded: the load spans two blocks and the second
    # fails. Recovery must scan every block under the load's target, the last,
    # partial one included.
    r = run([{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 2,
              "ext": 4, "async": True},
             {"op": "step"}, {"op": "step", "finish_loads": ["r0"], "fail": ["r0"],
                              "fail_offset": 1}],
            block_size=3, num_blocks=8)
    assert r.obs.requests["r0"].num_computed_tokens == 3
    r.apply({"op": "drain"})
    assert not r.obs.requests


def test_threshold_of_one_token_caps_competing_prefills():
    r = run([{"op": "add", "id": "r0", "prompt": [20, 21, 22, 23, 24, 25], "max_tokens": 1},
             {"op": "add", "id": "r1", "prompt": [30, 31, 32, 33, 34, 35], "max_tokens": 1},
             {"op": "step"}],
            block_size=2, num_blocks=12, max_num_batched_tokens=4,
            long_prefill_token_threshold=1)
    assert all(r.obs.requests[rid].num_computed_tokens <= 2 for rid in ("r0", "r1"))
    r.apply({"op": "drain"})


@pytest.mark.parametrize("owner, waiters", [("r0", ("r1", "r2")), ("z", ("a", "b"))])
def test_shared_failed_block_owner_whatever_its_name(owner, waiters):
    # The owner is the first affected request in scan order, whatever the ids;
    # exactly one request recomputes the failed block, the others wait.
    prompt = [1, 2, 3, 4, 5, 6]
    r = run([{"op": "add", "id": owner, "prompt": prompt + [7], "max_tokens": 3, "ext": 6}]
            + [{"op": "add", "id": w, "prompt": prompt + [8 + k], "max_tokens": 3}
               for k, w in enumerate(waiters)]
            + [{"op": "step", "fail": [owner], "fail_offset": 1}, {"op": "step"},
               {"op": "step"}, {"op": "drain"}],
            block_size=2, num_blocks=16, max_num_batched_tokens=32,
            long_prefill_token_threshold=2)
    assert not r.obs.requests


@pytest.mark.parametrize("block_size", [2, 3])
@pytest.mark.parametrize("failed_block", [0, 1, 2])
def test_chunked_owner_and_waiters_past_the_first_block(block_size, failed_block):
    # The store holds the whole shared prefix and one of its blocks fails; the
    # owner recomputes chunk by chunk while two waiters hold the same blocks.
    # A waiter truncated at a later block must still wait for exactly that block.
    prompt = list(range(1, 3 * block_size + 1))
    r = run([{"op": "add", "id": "r0", "prompt": prompt + [40], "max_tokens": 3,
              "ext": len(prompt)},
             {"op": "add", "id": "r1", "prompt": prompt + [41], "max_tokens": 3},
             {"op": "add", "id": "r2", "prompt": prompt + [42], "max_tokens": 3},
             {"op": "add", "id": "r3", "prompt": [30, 31], "max_tokens": 6},
             {"op": "step", "fail": ["r0"], "fail_offset": failed_block},
             {"op": "step"}, {"op": "abort", "id": "r3"}, {"op": "step"}, {"op": "step"},
             {"op": "drain"}],
            block_size=block_size, num_blocks=24, max_num_batched_tokens=64,
            long_prefill_token_threshold=block_size - 1)
    assert not r.obs.requests


def test_one_token_prompt_fully_loaded_gives_its_block_back_while_waiting():
    # Nothing of a one-token prompt can be kept (its only token is recomputed):
    # while the seat is taken, the finished load must not hold its block.
    r = run([{"op": "add", "id": "r0", "prompt": [5], "max_tokens": 1, "ext": 1,
              "async": True},
             {"op": "add", "id": "r1", "prompt": [20, 21, 22, 23], "max_tokens": 4},
             {"op": "step"}, {"op": "step", "finish_loads": ["r0"]}, {"op": "step"},
             {"op": "drain"}],
            block_size=2, num_blocks=12, max_num_seqs=1)
    assert not r.obs.requests


def test_drafts_near_max_model_len_are_cut_below_it():
    # Every decode step proposes two drafts, all rejected, so decoding advances one
    # token a step; near max_model_len the scheduler
    # must drop the drafts that would run a position at max_model_len - 1 or past.
    r = run([{"op": "add", "id": "r0", "prompt": list(range(1, 9)), "max_tokens": 6}]
            + [{"op": "step", "drafts": 2} for _ in range(5)]
            + [{"op": "drain"}],
            block_size=2, num_blocks=12, max_model_len=12)
    assert not r.obs.requests
