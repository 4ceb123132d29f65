"""``kvspec replay A B C``: each result is printed under the trace it is of, and
the summary names the traces of the smaller group (a replay of 23 finding traces
once printed 23 unnamed results and '22 still fail', leaving the reader to count
blocks to find the one that passed)."""
from __future__ import annotations

import shutil
from pathlib import Path

from cli_run import run_kvspec
from kvspec.cli import describe_replays

REGRESSIONS = Path(__file__).resolve().parents[1] / "model_tests" / "impl_regressions"


def test_the_summary_names_the_smaller_group():
    traces = [Path(f"/x/{n}.json") for n in "abcd"]
    assert describe_replays(traces, [1, 1, 0, 1]).strip() == (
        "4 traces replayed: 3 still fail; passing: c.json")
    assert describe_replays(traces, [0, 1, 0, 0]).strip() == (
        "4 traces replayed: 1 still fail; still failing: b.json")
    assert describe_replays(traces, [0, 0, 0, 0]).strip() == "4 traces replayed: 0 still fail"


def test_each_result_is_printed_under_its_trace(tmp_path):
    traces = sorted(REGRESSIONS.glob("*.json"))[:2]
    copies = [shutil.copy(t, tmp_path / t.name) for t in traces]
    done = run_kvspec(tmp_path, "replay", *map(str, copies))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for trace in copies:
        at = lines.index(f"{trace}:")
        assert lines[at + 1].startswith("replayed "), lines[at:at + 3]
    assert lines[-1] == "2 traces replayed: 0 still fail"


def test_a_verdict_is_the_same_when_only_a_source_line_moved():
    """0.33.0 raises the same assert as 0.32.0 at another line: 'still fails
    (same verdict as recorded)', not 'verdict differs from the recording'."""
    from kvspec.harness.replay import get_comparable
    recorded = [("target_crashed", "AssertionError: at vllm/v1/core/sched/scheduler.py:1170: "
                                   "assert num_new_tokens > 0")]
    moved = [("target_crashed", "AssertionError: at vllm/v1/core/sched/scheduler.py:1347: "
                                "assert num_new_tokens > 0")]
    other = [("target_crashed", "AssertionError: at vllm/v1/core/sched/scheduler.py:1347: "
                                "assert request.num_output_placeholders >= 0")]
    assert get_comparable(recorded) == get_comparable(moved)
    assert get_comparable(recorded) != get_comparable(other)
