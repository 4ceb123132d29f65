"""SIGINT and SIGTERM stop a run cleanly (issue 28, item 6): exit 130, the
partial summary under an INTERRUPTED verdict, and no violation reported.

Before, Hypothesis' teardown drained a step the interrupt had left half
applied and could report a violation that replays clean (a cancelled CI job
gone red on correct code); an interrupt landing in a gc callback was dropped
by Python and the run went on to its budget. The moments below count from the
run's first line (so a loaded machine's slow imports do not shift them) and
span preparing, the first runs and steady fuzzing. An interrupt during
Python's own start-up, before kvspec runs, is Python's (a traceback).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

MOMENTS = [0.0, 0.3, 0.8, 1.5, 3.0]


def _interrupt(tmp_path: Path, after: float, sig: int) -> tuple[int, str, str, list[Path]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvspec.cli", "check", "--target", "impl", "--budget", "30s"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        # a child of a non-interactive shell may inherit SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.readline()  # "kvspec: target impl, seed 0, ...": kvspec runs
    time.sleep(after)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, first + out, err, list((tmp_path / ".kvspec").rglob("*.json"))


@pytest.mark.parametrize("after", MOMENTS)
def test_sigint_stops_the_run_and_reports_nothing(tmp_path, after):
    code, out, err, traces = _interrupt(tmp_path, after, signal.SIGINT)
    assert code == 130, (code, out[-800:], err[-800:])
    assert "kvspec: interrupted" in err
    assert "VIOLATED" not in out and not traces, (out[-800:], traces)
    assert "Exception ignored" not in err, err[-800:]
    if "fuzzing" in err or "INTERRUPTED" in out:  # the run had begun: its partial summary
        assert "INTERRUPTED after" in out and "runs," in out, out[-800:]


def test_sigterm_stops_the_run_the_same_way(tmp_path):
    code, out, err, traces = _interrupt(tmp_path, 1.5, signal.SIGTERM)
    assert code == 130 and "INTERRUPTED after" in out and not traces, (code, out[-800:])

