"""Issue 13, parts 5 and 6: the scheduler's steps run on real KV tensors
(``kvspec.harness.torch_worker``). Over generated workloads the greedy tokens
and logits of every request equal the no-cache model's, per-block checksums
agree with the data oracle every step, and the pre-#34616 mutant reads wrong
KV and samples wrong tokens.

CPU only, a few seconds each. The whole file skips, saying why, without torch.
"""
from __future__ import annotations

import json
from collections import Counter

import attrs
import pytest

torch = pytest.importorskip("torch", reason="the torch worker needs torch: "
                                            "pip install -e '.[gpu]' (torch==2.13.0)")

from hypothesis import Phase  # noqa: E402
from kvspec.cli import run  # noqa: E402
from kvspec.harness.machine import machine_for  # noqa: E402
from kvspec.harness.profiles import FULL  # noqa: E402
from kvspec.harness.replay import replay_trace  # noqa: E402
from kvspec.harness.runner import KV_CLAIM, Counterexample, Runner  # noqa: E402
from kvspec.harness.target import make_config  # noqa: E402
from kvspec.harness.torch_worker import LOGITS_TOL, TorchWorker  # noqa: E402
from kvspec.harness.trace import save_trace  # noqa: E402
from kvspec.spec.state import GroupSpec, RequestStatus  # noqa: E402

from random_runs import run_machine  # noqa: E402

#: the layouts the tiny model has (a last-state group needs a recurrent layer)
TORCH_PROFILE = attrs.evolve(FULL, layouts=("full", "sliding"))


def run_workloads(profile, seed: int, examples: int, target: str = "impl") -> Counter:
    """Generated workloads (the fuzzer's state machine: shared prefixes, a small
    pool, offloading stores, sync and async loads, injected failures, aborts,
    resets) on real tensors; every claim and the torch worker's checks hold,
    or this raises. Returns what the runs exercised."""
    stats: Counter = Counter()

    class Machine(machine_for(target, profile=profile, kv="torch")):
        def teardown(self):
            try:
                super().teardown()
            finally:
                if self.runner is not None:
                    stats.update(self.runner.worker.stats)
                    stats.update({f"feature:{k}": v for k, v in self.runner.features.items()})

    run_machine(Machine, seed, examples, 25, phases=(Phase.generate,))
    return stats


def test_greedy_tokens_and_logits_equal_the_no_cache_model_under_recompute():
    stats = run_workloads(attrs.evolve(TORCH_PROFILE, failure_policies=("recompute",)),
                          seed=11, examples=70)
    # every request that ended with output was compared with the reference
    assert stats["requests_checked_end_to_end"] >= 50, stats
    assert stats["requests_ended_with_error"] == 0
    # what the workloads went through, on real tensors
    assert stats["feature:kv_torch"] > 500 and stats["blocks_checked"] > 5000, stats
    assert stats["feature:load_failures"] > 0 and stats["feature:failure_policy_recompute"] > 0
    assert stats["feature:preemptions"] > 0 and stats["feature:async_loads"] > 0
    assert stats["feature:sliding_window"] > 0 and stats["feature:async_scheduling"] > 0
    assert stats["feature:spec_decode"] > 0
    # offload then reload: blocks this run saved came back from the store
    assert stats["blocks_offloaded"] > 0 and stats["blocks_from_store"] > 0, stats
    assert stats["blocks_from_remote"] > 0 and stats["partial_blocks_loaded"] > 0, stats


DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device: the CUDA path of the "
               "torch worker runs where a GPU is present"))]


@pytest.mark.parametrize("device", DEVICES)
def test_the_same_workloads_are_exact_on_each_device(device, monkeypatch):
    """The worker's tensors on ``device`` (CUDA when present by default): a
    short run of generated workloads with failures holds every claim, and the
    pre-#34616 mutant is caught there too."""
    from kvspec.harness import torch_worker
    monkeypatch.setattr(torch_worker, "DEVICE", device)
    stats = run_workloads(TORCH_PROFILE, seed=13, examples=12)
    assert stats["requests_checked_end_to_end"] >= 5 and stats["feature:kv_torch"] > 50, stats
    mutant = Runner("mutant:async_block_rounding", ROUNDING_CONFIG, kinds=(), kv="torch")
    assert mutant.worker.cache.kv.device.type == device
    failure = mutant.run(ROUNDING_ACTIONS)
    assert failure is not None and {v.invariant for v in failure.violations} == {KV_CLAIM}


def test_under_fail_the_affected_requests_end_with_an_error_and_the_rest_are_exact():
    stats = run_workloads(attrs.evolve(TORCH_PROFILE, failure_policies=("fail",)),
                          seed=12, examples=60)
    assert stats["feature:failure_policy_fail"] > 0, stats
    assert stats["requests_ended_with_error"] > 0, stats
    assert stats["requests_checked_end_to_end"] >= 40, stats


#: the pre-#34616 case: an async load of 2 tokens into blocks of 3; the mutant
#: counts the whole block, so position 2 is read though nothing wrote it
ROUNDING_CONFIG = make_config(block_size=3, num_blocks=5, max_num_batched_tokens=4,
                              max_num_seqs=1, max_model_len=12, async_scheduling=True)
ROUNDING_ACTIONS = [{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 12], "max_tokens": 6,
                     "ext": 2, "async": True}, {"op": "drain"}]


def run_all(runner: Runner, actions) -> list:
    """Every violation of every action, going on after each (to see what the
    first one leads to)."""
    found = []
    for action in actions:
        try:
            runner.apply(action)
        except Counterexample as exc:
            found += exc.violations
    return found


def test_the_pre_34616_mutant_reads_wrong_kv_where_the_reference_is_exact():
    reference = Runner("impl", ROUNDING_CONFIG, kv="torch")
    assert reference.run(ROUNDING_ACTIONS) is None
    assert reference.worker.stats["requests_checked_end_to_end"] == 1
    # the torch worker alone (no spec claim checked) catches the mutant
    mutant = Runner("mutant:async_block_rounding", ROUNDING_CONFIG, kinds=(), kv="torch")
    failure = mutant.run(ROUNDING_ACTIONS)
    assert failure is not None
    messages = [v.message for v in failure.violations if v.invariant == KV_CLAIM]
    assert any("block" in m and "read or written by r0" in m and "oracle agrees" in m
               for m in messages), messages


def test_the_pre_34616_mutant_samples_wrong_tokens(monkeypatch):
    """With the per-block checks off (and synchronous scheduling, so the run
    goes on without the state claims), the request ends with a token the
    no-cache model does not produce."""
    monkeypatch.setattr(TorchWorker, "_check", lambda self, *args: set())
    config = attrs.evolve(ROUNDING_CONFIG, async_scheduling=False)
    found = run_all(Runner("mutant:async_block_rounding", config, kinds=(), kv="torch"),
                    ROUNDING_ACTIONS)
    assert [v.message for v in found] == [
        "r0: token 5 is 7, the no-cache model's greedy token is 23 (FINISHED_LENGTH_CAPPED)"]
    # the same actions on the reference, with the same checks off, are exact
    assert run_all(Runner("impl", config, kinds=(), kv="torch"), ROUNDING_ACTIONS) == []


def test_the_end_to_end_check_names_a_wrong_token_and_wrong_logits():
    runner = Runner("impl", make_config(block_size=4, num_blocks=10, max_model_len=24),
                    kv="torch")
    runner.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 4})
    for _ in range(3):
        runner.apply({"op": "step"})
    view = runner.target.observe().requests["r0"]
    assert len(view.output_token_ids) == 3
    worker = runner.worker
    rows = dict(worker.sampled_rows["r0"])
    assert worker.check_ended(view) == []
    wrong = attrs.evolve(view, output_token_ids=view.output_token_ids[:2]
                         + ((view.output_token_ids[2] + 1) % 101,))
    [v] = worker.check_ended(wrong)
    assert "r0: token 9 is" in v.message and "greedy token is" in v.message
    worker.sampled_rows["r0"] = {p: row + (10 * LOGITS_TOL if p == 8 else 0)
                                 for p, row in rows.items()}
    [v] = worker.check_ended(view)
    assert "logits token 8 was sampled from differ" in v.message
    worker.sampled_rows["r0"] = rows
    errored = attrs.evolve(wrong, status=RequestStatus.FINISHED_ERROR)
    assert worker.check_ended(errored) == []  # policy "fail": ended with an error


def test_a_block_corrupted_behind_the_schedulers_back_is_named(monkeypatch):
    """A block the step reads that holds wrong KV, with no reported failure,
    is a violation naming the step, the block and the request."""
    runner = Runner("impl", make_config(block_size=4, num_blocks=10, max_model_len=24),
                    kv="torch")
    runner.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 3})
    runner.apply({"op": "step"})
    block = runner.target.observe().requests["r0"].block_ids[0][0]
    runner.worker.cache.kv[block, 0, 0, 1] += 1.0  # a bit flip's worth of damage
    with pytest.raises(Counterexample) as caught:
        runner.apply({"op": "step"})
    [v] = [v for v in caught.value.violations if v.invariant == KV_CLAIM][:1]
    assert f"block {block} (index 0, group 0)" in v.message and "r0" in v.message
    assert "layers [0]" in v.message and "step 1" in v.message


def test_a_sliding_window_layout_runs_exact():
    config = make_config(block_size=2, num_blocks=24, max_model_len=20,
                         groups=(GroupSpec(2), GroupSpec(2, "sliding_window", 3)))
    runner = Runner("impl", config, kv="torch")
    actions = [{"op": "add", "id": f"r{i}", "prompt": [1, 2, 3, 4, 5, 6, 7, 1, 10 + i],
                "max_tokens": 4, "ext": 6 if i == 0 else 0, "offload": True} for i in range(3)]
    assert runner.run(actions + [{"op": "drain"}]) is None
    assert runner.worker.stats["requests_checked_end_to_end"] == 3
    assert runner.features["sliding_window"] > 0


def test_a_torch_trace_replays_to_the_same_verdict(tmp_path):
    failure = Runner("mutant:async_block_rounding", ROUNDING_CONFIG,
                     kv="torch").run(ROUNDING_ACTIONS)
    path = save_trace(tmp_path / "t.json", target="mutant:async_block_rounding",
                      config=ROUNDING_CONFIG, actions=list(failure.runner.actions),
                      violations=failure.violations, kv="torch")
    assert json.loads(path.read_text())["kv"] == "torch"
    outcome = replay_trace(path)
    assert outcome.violations and outcome.same_as_recorded


def test_check_kv_torch_holds_on_impl_and_counts_the_steps(tmp_path, capsys):
    # cli.run, not CliRunner: --json points the module's console at stderr for
    # one command, and run() puts it back
    code = run(["check", "--target", "impl", "--kv", "torch", "--budget", "4s", "--seed", "1",
                "--json", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["verdict"] == "hold" and report["features"]["kv_torch"] > 0
    assert report["profile"]["restrictions"]["layouts"] == ["full", "sliding"]
    # the torch worker's claim has its row, as the README calls it a claim
    row = next(c for c in report["claims"] if c["name"] == "kv_tensors_match_oracle")
    assert row["checked"] == row["witnessed"] == report["features"]["kv_torch"]
    assert row["violations"] == 0 and row["kind"] == "data"


@pytest.mark.parametrize("args, message", [
    (["--kv", "tensors"], "invalid --kv 'tensors': use symbolic or torch"),
    (["--target", "vllm", "--kv", "torch"], "--kv torch runs on the impl"),
    (["--kv", "torch", "--layouts", "full,state"], "has a last-state group"),
])
def test_bad_kv_options_are_one_line_errors(tmp_path, capsys, args, message):
    code = run(["check", "--budget", "2s", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_failed_load_leaves_garbage_it_reports_and_recompute_makes_it_exact():
    """The environment fails the second block of a sync load: that block holds
    the loader's garbage (far off the reference) and is reported; the
    scheduler recomputes it and the request still ends exact."""
    from kvspec.gpu.checksum import check_blocks
    config = make_config(block_size=4, num_blocks=10, max_model_len=24)
    runner = Runner("impl", config, kv="torch")
    runner.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6, 7, 1, 2, 10],
                  "max_tokens": 3, "ext": 8})
    seen = {}
    execute = runner.worker.execute

    def spy(step, mid, pending, run_oracle):
        report = execute(step, mid, pending, run_oracle)
        table = mid.requests["r0"].block_ids[0]
        kv = runner.worker.references.get_kv(mid.requests["r0"].all_token_ids)
        seen["invalid"] = set(report.invalid_block_ids)
        seen["mismatch"] = {m.block_id for m in check_blocks(runner.worker.cache, [
            runner.worker._expect("r0", table[i], i, 0, kv, 4) for i in (0, 1)], 0)}
        seen["block"] = table[1]
        return report
    runner.worker.execute = spy
    runner.apply({"op": "step", "fail": ["r0"], "fail_offset": 1})
    assert seen["invalid"] == seen["mismatch"] == {seen["block"]}
    runner.worker.execute = execute
    assert runner.run([{"op": "drain"}]) is None
    assert runner.worker.stats["requests_checked_end_to_end"] == 1
