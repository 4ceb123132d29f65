"""The counterexample as the terminal shows it: the configuration first, and
the row where the claims broke marked (a run stops at that step)."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from rich.console import Console

from kvspec.harness.target import make_config
from kvspec.report import config_line, print_counterexample
from kvspec.spec.registry import Violation


def render(steps, violations, config=None) -> str:
    console = Console(record=True, width=200, color_system=None)
    print_counterexample(console, steps, violations, config=config)
    return console.export_text()


STEPS = [NS(index=0, action="add(id=r0)", requests="r0:WAITING c=0/4 b=[]"),
         NS(index=1, action="step()", requests="r0:RUNNING c=4/4 b=[0]")]


def test_the_last_row_is_marked_where_the_claims_broke():
    out = render(STEPS, [Violation("cached_le_computed", "r0 caches 8 of 4")])
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert "1 *" in rows[-1] and "*" not in rows[0]
    assert "the claims below broke at step 1, the last row" in out


def test_rows_that_repeat_are_one_row_and_the_last_is_always_shown():
    """A drain's steps that change nothing shown (about 33 rows of
    'r1:RUNNING c=11/12' in a battery trace) are folded into one row."""
    same = NS(action="drain.step()", requests="r1:RUNNING c=11/12 b=[0]")
    steps = [NS(index=0, action="add(id=r1)", requests="r1:WAITING c=0/12 b=[]")] + [
        NS(index=k, action=same.action, requests=same.requests) for k in range(1, 35)]
    out = render(steps, [Violation("every_request_finishes", "r1 never finished")])
    assert "32 more rows like step 1 (steps 2-33)" in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 4 and "34 *" in rows[-1], out  # add, step 1, the fold, the last


def test_no_mark_without_a_violation_and_the_configuration_comes_first():
    config = make_config(block_size=4, num_blocks=9, max_num_batched_tokens=4, max_num_seqs=2,
                         max_model_len=13)
    out = render(STEPS, [], config)
    assert out.startswith(f"configuration: {config_line(config)}"[:60])
    assert f"configuration: {config_line(config)}" in " ".join(out.split())
    assert "block size 4, 9 blocks" in out and "*" not in out


def test_a_claim_the_drawn_environment_cannot_reach_says_why_not_longer_run():
    """A claim the profile rules out is never promised to a longer run."""
    import attrs

    from kvspec.harness.profiles import MODELLED
    from kvspec.report import get_unreachable, unwitnessed
    assert get_unreachable(MODELLED) == {}  # the whole environment reaches every claim
    narrow = attrs.evolve(MODELLED, layouts=("full",), scheduling=("sync",),
                          load_failures=False, kv_roles=("kv_consumer",))
    why = get_unreachable(narrow)
    assert set(why) == {"every_group_serves_computed", "hit_with_last_state_leaves_last_token",
                        "placeholders_nonnegative", "placeholders_match_in_flight",
                        "failed_block_recomputed_once", "send_source_intact"}
    assert "layouts=full" in why["every_group_serves_computed"]
    told = unwitnessed({}, {}, unseen=why)
    assert "longer run" not in told["every_group_serves_computed"]
    assert "longer run" in told["stats_set_exactly_once"]  # reachable: a longer run may


def test_a_real_connector_that_rules_a_claim_out_is_named():
    """A claim only a connector's async loads, failed loads or delayed frees
    witness: where kvspec's world for the connector says it never does them
    and the run showed none, the reason is the connector's code, not the
    run's length. Needs vLLM (the connector's class is looked up)."""
    pytest.importorskip("vllm", reason="needs vLLM to look the connector up")
    from kvspec.report import SILENT_CONNECTOR_CLAIMS, get_connector_silence, unwitnessed
    target = "vllm?connector=ExampleConnector"
    silent = get_connector_silence(target, {})
    assert set(silent) == set(SILENT_CONNECTOR_CLAIMS)
    assert silent["async_load_has_tokens"].startswith(
        "ExampleConnector answers no asynchronous load: its own code rules")
    assert "reports no failed load" in silent["no_caching_of_invalid_blocks"]
    told = unwitnessed({}, {}, unseen=silent)
    assert "no budget reaches it" in told["send_source_intact"]
    # a run that showed it (a subclass that loads asynchronously): no such reason
    some = get_connector_silence(target, {"async_loads": 3})
    assert "async_load_has_tokens" not in some and "no_caching_of_invalid_blocks" not in some
    assert "send_source_intact" in some
    # a connector whose transfers the run draws (NIXL): kvspec does not know, says nothing
    assert get_connector_silence("vllm?connector=NixlConnector", {}) == {}
    # kvspec's own connector answers as the run draws: nothing to say of it
    assert get_connector_silence("vllm", {}) == {} and get_connector_silence("impl", {}) == {}


def test_a_crash_says_where_it_raised_beside_its_message():
    """A TypeError deep in vLLM names no place; the line under the crash does
    (file:line and function). The message, which recorded verdicts compare,
    stays as it was."""
    from kvspec.harness.runner import describe_crash

    def unpack_the_answer(answer):
        delay, params = answer
        return delay, params
    try:
        unpack_the_answer(True)
    except TypeError as exc:
        crash = describe_crash(exc)
    assert crash.invariant == "target_crashed"
    assert crash.message == "TypeError: cannot unpack non-iterable bool object"
    assert "test_report.py:" in crash.doc and crash.doc.endswith(" in unpack_the_answer.")


def test_an_out_of_tree_connector_that_never_loaded_async_is_not_promised_a_longer_run():
    """A connector kvspec knows nothing of (a generic world) that answered no
    asynchronous load and delayed no free in the run: the reason says so and
    that no budget helps if its code never does, rather than "a longer run may
    reach it". One that did in the run gets no such reason."""
    pytest.importorskip("vllm", reason="needs vLLM to look the connector up")
    from kvspec.report import SILENT_CONNECTOR_CLAIMS, get_connector_silence
    target = "vllm?connector=model_tests.connectors.async_store:AsyncPrefixStore"
    silent = get_connector_silence(target, {"async_loads": 0})
    assert set(silent) == set(SILENT_CONNECTOR_CLAIMS) - {"no_caching_of_invalid_blocks"}
    assert silent["async_load_has_tokens"] == (
        "AsyncPrefixStore answers no asynchronous load in this run: if its code never does, "
        "no budget reaches it")
    assert "never delays a finished request's free" in silent["send_source_intact"]
    assert "async_load_has_tokens" not in get_connector_silence(target, {"async_loads": 2})
