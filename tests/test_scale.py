"""Production-sized runs in the environment (issue 30, item 3): some runs of a
campaign draw vLLM's block size, thousands of blocks, 64-256 concurrent
requests and prompts of thousands of tokens, and ``check --json`` counts them."""
from __future__ import annotations

import importlib.util
import json

import pytest
from hypothesis import Verbosity
from typer.testing import CliRunner

from kvspec.cli import app
from kvspec.harness.fuzz import PRODUCTION_EVERY, fuzz, get_batch_scale
from kvspec.harness.machine import (MAX_WAVE_PROMPT, PRODUCTION_MODEL_LEN, SCALE_ENV,
                                    get_scale, machine_for)
from kvspec.harness.replay import replay_trace
from kvspec.harness.trace import save_trace

from random_runs import run_machine

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def run_production(target: str, steps: int = 6, seed: int = 3) -> list:
    """One production-sized run of ``steps`` rules; the runners it made."""
    runners = []
    machine = machine_for(target, scale="production")
    original = machine.teardown

    def teardown(self):
        runners.append(self.runner)
        original(self)
    machine.teardown = teardown
    run_machine(machine, seed, 1, steps, verbosity=Verbosity.quiet)
    assert machine.stats["scale:production"] == machine.stats["runs"] >= 1
    return runners


def assert_production_sized(runner) -> None:
    config = runner.config
    assert config.block_size == 16 and config.max_model_len == PRODUCTION_MODEL_LEN
    assert 1_000 <= config.num_blocks <= 10_500, config.num_blocks
    assert 64 <= config.max_num_seqs <= 256 and 1024 <= config.max_num_batched_tokens <= 8192
    prompts = [len(a["prompt"]) for a in runner.actions if a["op"] == "add"]
    long = [n for n in prompts if n >= 1_000]
    assert len(long) >= 16 and max(long) <= MAX_WAVE_PROMPT, prompts


def test_a_production_run_is_production_sized_and_its_trace_replays(tmp_path):
    """What the fuzzer draws at production scale, and that such a run is data
    like any other: saved, replayed, judged the same."""
    runners = run_production("impl")
    assert_production_sized(runners[0])
    r = runners[0]
    # the healed phase ran every long request to its end
    assert sum(row.action == "drain.step()" for row in r.log) >= 5 and not r.obs.requests
    path = tmp_path / "production.json"
    save_trace(path, target="impl", config=r.config, actions=list(r.actions), violations=[],
               steps=r.log, seed=3)
    outcome = replay_trace(path, "impl")
    assert outcome.violations == [] and outcome.same_as_recorded
    assert len(outcome.actions_run) == len(r.actions) and len(outcome.steps) == len(r.log)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM installed (the vllm target)")
def test_vllm_runs_at_production_size():
    runners = run_production("vllm", steps=4)
    assert_production_sized(runners[0])


def test_mixed_makes_one_batch_in_sixteen_production_sized():
    sizes = [get_batch_scale("mixed", b) for b in range(3 * PRODUCTION_EVERY)]
    assert sizes.count("production") == 3 and sizes[PRODUCTION_EVERY - 1] == "production"
    assert sizes[0] == "small"  # a campaign starts with the fast runs
    assert {get_batch_scale(s, 5) for s in ("small", "production")} == {"small", "production"}


def test_a_campaign_counts_its_runs_by_scale(tmp_path):
    result = fuzz("impl", budget=60, seed=0, out_dir=tmp_path, db_dir=None,
                  max_examples=1, scale="production", step_count=4)
    assert result.scales == {"production": 1} and result.counterexample is None
    with pytest.raises(ValueError, match="scale 'huge'"):
        fuzz("impl", budget=1, seed=0, out_dir=tmp_path, scale="huge")


@pytest.fixture(autouse=True)
def no_scale_left_behind(monkeypatch):
    """``--scale`` writes the environment (for the workers): undone after each test."""
    monkeypatch.setenv(SCALE_ENV, "")


def test_a_mixed_campaign_switches_sizes(tmp_path, monkeypatch):
    from kvspec.harness import fuzz as fuzz_module
    monkeypatch.setattr(fuzz_module, "PRODUCTION_EVERY", 2)
    result = fuzz("impl", budget=60, seed=0, out_dir=tmp_path, max_examples=2, step_count=3,
                  batch_examples=1, scale="mixed")
    assert result.scales == {"small": 1, "production": 1}, result.scales


def test_check_runs_mixed_unless_told(tmp_path, monkeypatch):
    """What ``kvspec check`` hands the fuzzer: mixed by default, small under
    ``--kv torch`` (its tiny model's vocabulary), and production refused there."""
    from kvspec.harness import fuzz as fuzz_module
    seen, original = [], fuzz_module.fuzz

    def fuzz_spy(*args, **kwargs):
        seen.append(kwargs["scale"])
        return original(*args, **{**kwargs, "scale": "small"})
    monkeypatch.setattr(fuzz_module, "fuzz", fuzz_spy)
    result = CliRunner().invoke(app, ["check", "--examples", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    refused = CliRunner().invoke(app, ["check", "--kv", "torch", "--scale", "production",
                                       "--out", str(tmp_path)])
    assert refused.exit_code == 2 and refused.stderr.strip().splitlines() == [
        "kvspec: error: --scale production: not with --kv torch (the tiny model's "
        "vocabulary holds fewer tokens than production prompts use)"]
    assert seen == ["mixed"]


def test_workers_sum_their_runs_by_scale():
    from kvspec.parallel import combine
    base = {"claims": [], "elapsed_s": 1.0, "actions": 1, "runs": 1, "violations": [],
            "verdict": "hold", "verdict_line": "", "trace": None, "exit_code": 0, "seed": 0,
            "unwitnessed": [], "state_checks": {}}
    summary = combine([dict(base, runs_by_scale={"small": 3, "production": 1}),
                       dict(base, runs_by_scale={"small": 2, "production": 0})])
    assert summary["runs_by_scale"] == {"small": 5, "production": 1}


def test_every_production_trace_replays(tmp_path):
    """Waves stop adding long requests before the trace would be too large to
    replay (``trace.check_size``): the largest pool and concurrency, waves of 64
    requests of up to 4,000 tokens, until the limit stops them."""
    from kvspec.harness.machine import Swarm
    from kvspec.harness.trace import check_size, load_trace
    machine = machine_for("impl", scale="production")()
    wave = dict(prefix=1, count=64, prefix_len=3000, suffix_len=1000, max_tokens=32, ext=0,
                load_async=False, send=False, offload=False)
    machine.configure(first_wave=wave, block_size=2, spare_blocks=12, budget=24,
                      max_num_seqs=4, max_model_len=24, threshold=0, policy="fcfs",
                      failure_policy="recompute", swarm=Swarm(), scheduling="sync",
                      kv_role="kv_both", async_drafts=0)
    for _ in range(4):
        machine.add_wave(**wave)
    r = machine.runner
    assert r.config.num_blocks >= 9_600 and r.config.max_num_seqs == 256
    adds = [a for a in r.actions if a["op"] == "add"]
    assert 16 <= len(adds) < 256, len(adds)  # the limit stopped the waves
    assert check_size(r.config, r.actions + [{"op": "drain"}]) is None
    path = save_trace(tmp_path / "big.json", target="impl", config=r.config,
                      actions=r.actions + [{"op": "drain"}], steps=r.log)
    assert len(load_trace(path)["actions"]) == len(adds) + 1


def test_check_json_counts_production_sized_runs(tmp_path):
    result = CliRunner().invoke(app, ["check", "--examples", "2", "--scale", "production",
                                      "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["runs_by_scale"] == {"small": 0, "production": 2}, report["runs_by_scale"]
    assert report["scale"] == "production"
    assert "2 runs (2 production-sized)" in result.stderr


def test_a_small_only_check_says_so_in_its_first_line(tmp_path):
    """Leaving production-sized runs out narrows the environment: the verdict's
    first line and --json's restrictions say so (asked: exit 0 all the same)."""
    result = CliRunner().invoke(app, ["check", "--examples", "1", "--scale", "small",
                                      "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert "narrowed as asked: scale=small (no production-sized run; --scale small)" \
        in report["verdict_line"]
    assert {"field": "scale", "value": "small", "kind": "asked",
            "why": "no production-sized run; --scale small"} in report["restrictions"]
    mixed = CliRunner().invoke(app, ["check", "--examples", "1", "--scale", "mixed",
                                     "--json", "--out", str(tmp_path)])
    assert "scale=" not in json.loads(mixed.stdout)["verdict_line"]


def test_a_bad_scale_is_one_line(tmp_path, monkeypatch):
    result = CliRunner().invoke(app, ["check", "--scale", "huge", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "kvspec: error: --scale 'huge': one of small, mixed, production"]
    monkeypatch.setenv(SCALE_ENV, "tiny")
    with pytest.raises(ValueError, match="KVSPEC_SCALE='tiny'"):
        get_scale()


def test_the_default_scale_is_mixed():
    assert get_scale() == "mixed"


def test_workers_sum_claims_by_name():
    """A row only some workers report (an outcome of a crash, the torch
    worker's claim) is summed by name: rows once lined up by position."""
    from kvspec.parallel import combine
    row = {"kind": "state", "role": "safety"}
    base = {"elapsed_s": 1.0, "actions": 1, "runs": 1, "violations": [], "verdict": "hold",
            "verdict_line": "", "trace": None, "exit_code": 0, "seed": 0, "unwitnessed": [],
            "state_checks": {}}
    plain = [dict(row, name="a", checked=2, witnessed=1, violations=0)]
    crashed = [dict(row, name="a", checked=3, witnessed=0, violations=0),
               dict(row, name="target_crashed", kind="outcome", checked=None, witnessed=None,
                    violations=1)]
    summary = combine([dict(base, claims=crashed), dict(base, claims=plain)])
    assert summary["claims"][0] == dict(row, name="a", checked=5, witnessed=1, violations=0)
    assert summary["claims"][1]["name"] == "target_crashed"
    assert summary["claims"][1]["violations"] == 1
