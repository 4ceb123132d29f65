"""Production-sized runs in the environment (issue 30, item 3): some runs of a
campaign draw vLLM's block size, thousands of blocks, 64-256 concurrent
requests and prompts of thousands of tokens, and ``check --json`` counts them."""
from __future__ import annotations

import importlib.util
import json

import pytest
from hypothesis import HealthCheck, Verbosity, settings
from hypothesis.stateful import run_state_machine_as_test
from typer.testing import CliRunner

from kvspec.cli import app
from kvspec.harness.fuzz import PRODUCTION_EVERY, fuzz, get_batch_scale
from kvspec.harness.machine import (MAX_WAVE_PROMPT, PRODUCTION_MODEL_LEN, SCALE_ENV,
                                    get_scale, machine_for)
from kvspec.harness.replay import replay_trace
from kvspec.harness.trace import save_trace

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
    machine._hypothesis_internal_use_seed = seed
    run_state_machine_as_test(machine, settings=settings(
        max_examples=1, stateful_step_count=steps, deadline=None, database=None,
        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet))
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


def test_check_json_counts_production_sized_runs(tmp_path, monkeypatch):
    monkeypatch.delenv(SCALE_ENV, raising=False)
    result = CliRunner().invoke(app, ["check", "--examples", "2", "--scale", "production",
                                      "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["runs_by_scale"] == {"small": 0, "production": 2}, report["runs_by_scale"]
    assert "2 runs (2 production-sized)" in result.stderr


def test_a_bad_scale_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(SCALE_ENV, raising=False)
    result = CliRunner().invoke(app, ["check", "--scale", "huge", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "kvspec: error: --scale 'huge': one of small, mixed, production"]
    monkeypatch.setenv(SCALE_ENV, "tiny")
    with pytest.raises(ValueError, match="KVSPEC_SCALE='tiny'"):
        get_scale()


def test_the_default_scale_is_mixed(monkeypatch):
    monkeypatch.delenv(SCALE_ENV, raising=False)
    assert get_scale() == "mixed"
