"""Bad input: clear errors, state unchanged, contract violations told apart."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.harness.runner import Counterexample, Runner
from kvspec.harness.target import make_config
from kvspec.impl import Request, Scheduler, SchedulerConfig

REGRESSION = (Path(__file__).resolve().parents[1] / "model_tests" / "regressions"
              / "cache_failed_block.json")


def make_scheduler():
    s = Scheduler(SchedulerConfig(block_sizes=(4,), num_blocks=8, max_model_len=16))
    s.add_request(Request("a", [1, 2, 3], 2))
    return s


def snapshot(s):
    return (list(s.requests), [r.request_id for r in s.waiting],
            [b.ref_cnt for b in s.kv.pool.blocks])


@pytest.mark.parametrize("request_, match", [
    (Request("b", [], 2), "empty prompt"),
    (Request("b", [1], 0), "max_tokens"),
    (Request("b", list(range(16)), 2), "max_model_len"),
    (Request("b", list(range(40)), 2), "max_model_len"),
    (Request("a", [1, 2], 2), "duplicate"),
])
def test_add_request_rejects_and_leaves_state_unchanged(request_, match):
    s = make_scheduler()
    before = snapshot(s)
    with pytest.raises(ValueError, match=match):
        s.add_request(request_)
    assert snapshot(s) == before


def test_connector_overclaim_is_an_environment_violation():
    r = Runner("impl", make_config(block_size=2, num_blocks=8, max_model_len=16))
    r.apply({"op": "add", "id": "r0", "prompt": [1, 2, 3], "max_tokens": 1, "ext": 5,
             "overclaim_ok": True})
    with pytest.raises(Counterexample) as info:
        r.apply({"op": "step"})
    assert [v.invariant for v in info.value.violations] == ["environment_contract"]
    assert "only 3 uncomputed tokens" in info.value.violations[0].message


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvspec", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args, needle", [
    (("check", "--budget", "banana"), "invalid budget"),
    (("check", "--budget", "-5s"), "invalid budget"),
    (("fuzz", "--target", "nope", "--budget", "1s"), "unknown target"),
])
def test_cli_bad_arguments_are_one_line(args, needle):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("content", ['{"format": "kvspec-trace/1"', '[]', '{"format": "x"}',
                                     '{"format": "kvspec-trace/1", "actions": [{"op": "boom"}]}'])
def test_malformed_traces_are_one_line(tmp_path, content):
    path = tmp_path / "t.json"
    path.write_text(content)
    proc = run_cli("replay", str(path))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("action", [{"op": "add", "id": "x"},
                                    {"op": "add", "id": "x", "prompt": "abc", "max_tokens": 1},
                                    {"op": "abort"}])
def test_malformed_action_is_one_line_not_a_target_crash(tmp_path, action):
    trace = json.loads(REGRESSION.read_text())
    trace["actions"] = [action]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    proc = run_cli("replay", str(path))
    assert proc.returncode == 2, proc.stdout
    assert "malformed action" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_missing_trace_is_one_line(tmp_path):
    proc = run_cli("replay", str(tmp_path / "missing.json"))
    assert proc.returncode == 2 and "no such trace file" in proc.stderr


def test_finish_requests_skips_unknown_ids_and_finishes_the_rest():
    s = make_scheduler()
    s.add_request(Request("b", [4, 5], 2))
    from kvspec.spec.state import RequestStatus
    s.finish_requests(["nope", "a", "b"], RequestStatus.FINISHED_ABORTED)
    assert not s.requests and not s.waiting



def test_every_run_has_one_hash_seed(monkeypatch):
    # kvspec starts itself again with PYTHONHASHSEED=0 unless the caller set one
    # (kvspec/hashseed.py), so a trace replays onto the same block ids everywhere
    import os

    from kvspec import hashseed
    starts = []
    monkeypatch.setenv("PYTHONHASHSEED", "unset below")
    monkeypatch.delenv("PYTHONHASHSEED")
    monkeypatch.setattr(hashseed.os, "execv", lambda exe, argv: starts.append((exe, argv)))
    monkeypatch.setattr(sys, "argv", ["kvspec", "check", "--budget", "5s"])
    hashseed.pin_hash_seed()
    assert os.environ["PYTHONHASHSEED"] == "0"
    assert starts == [(sys.executable, [sys.executable, "-m", "kvspec", "check", "--budget", "5s"])]
    hashseed.pin_hash_seed()  # the seed is set now: no second start
    assert len(starts) == 1
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    shown = subprocess.run([sys.executable, "-m", "kvspec", "--help"], env=env,
                           capture_output=True, text=True)
    assert shown.returncode == 0 and "Usage" in shown.stdout, shown.stderr[-500:]


def _command_names() -> list[str]:
    from typer.main import get_command

    from kvspec.cli import app
    return sorted(get_command(app).commands)


@pytest.mark.parametrize("command", _command_names())
def test_every_command_help_renders(command):
    """Help text is Rich markup: an unescaped "[/N]" made ``kvspec fuzz --help``
    fail with a MarkupError. Every command's help must render, options listed."""
    from typer.testing import CliRunner

    from kvspec.cli import app
    shown = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output[-500:]
    assert "Usage" in shown.output and "--help" in shown.output


def test_a_long_target_name_still_names_a_trace_file(tmp_path):
    """``vllm?fixes=`` with a dozen fixes is longer than a file name may be:
    the trace of a failure met with it was lost to "File name too long" before
    it was saved. Its stem is cut short and told apart by a hash."""
    from kvspec.harness.fuzz import MAX_STEM, safe_file_stem
    from kvspec.harness.vllm_patches import FIXES
    long_name = "vllm?fixes=" + ",".join(sorted(FIXES))
    stem = safe_file_stem(long_name)
    assert len(stem) <= MAX_STEM and stem.startswith("vllm-fixes-")
    assert stem != safe_file_stem(long_name[:-1])
    (tmp_path / f"{stem}-seed12345.json").write_text("{}")  # the OS takes it
    assert safe_file_stem("vllm?fixes=none&plant=a") == "vllm-fixes-none-plant-a"
