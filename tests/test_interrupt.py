"""SIGINT and SIGTERM stop a run cleanly (issue 28, item 6): exit 130, the
partial summary under an INTERRUPTED verdict, and no violation reported; SIGKILL,
which nothing can catch, loses no failure already saved.

Before, Hypothesis' teardown drained a step the interrupt had left half
applied and could report a violation that replays clean (a cancelled CI job
gone red on correct code); an interrupt landing in a gc callback was dropped
by Python and the run went on to its budget. The moments below count from the
run's first line (so a loaded machine's slow imports do not shift them) and
span preparing, the first runs and steady fuzzing. An interrupt while kvspec's
command line is still being imported (a second or more) is one too: exit 130
and one line, no traceback (the interpreter's own start-up, before any
kvspec code runs, is Python's: a few milliseconds, longer on a loaded machine).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: 20 moments (issue 28's acceptance): the start, the first runs, steady fuzzing
MOMENTS = [0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.25,
           1.5, 1.8, 2.1, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.5]


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


#: python is up (its own start-up, which kvspec cannot touch, is over): run kvspec
#: (kvspec/__main__.py imports nothing heavy before main())
STARTED = ("import sys; import kvspec.__main__ as m; "
           "sys.argv = ['kvspec', 'check', '--target', 'impl', '--budget', '30s']; "
           "print('up', flush=True); m.main()")


@pytest.mark.parametrize("after", [0.05, 0.1, 0.25, 0.5, 0.8, 1.2])
def test_sigint_while_kvspec_starts_is_one_line(tmp_path, after):
    """Counted from the moment kvspec's own code starts (the hash seed set, so
    that it does not start again): the imports of the command line (typer,
    rich, Hypothesis, jsonschema) and what follows."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STARTED],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONHASHSEED="0"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == "up\n"
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err[-800:])
    assert "kvspec: interrupted" in err and "Traceback" not in err, err[-800:]
    assert "VIOLATED" not in out


def test_sigterm_stops_the_run_the_same_way(tmp_path):
    code, out, err, traces = _interrupt(tmp_path, 1.5, signal.SIGTERM)
    assert code == 130 and "INTERRUPTED after" in out and not traces, (code, out[-800:])



def test_sigkill_loses_no_saved_failure(tmp_path):
    """A counterexample is saved (atomically) before it is shrunk or reported, so a
    run killed right after the trace appears leaves a whole trace that replays
    failing (a shell's ``*.json`` skips the hidden scratch file of a shrink step)."""
    target, out = "mutant:free_during_send", tmp_path / "failures"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvspec.cli", "fuzz", "--target", target, "--budget", "60s",
         "--out", str(out), "--db", str(tmp_path / "db")], cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    while not _traces(out) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.kill()  # SIGKILL: no handler, no teardown
    proc.wait(timeout=30)
    traces = _traces(out)
    assert len(traces) == 1, list(out.iterdir()) if out.exists() else "no --out"
    # a shrink step's scratch file may be left (.pending-*, hidden from `*.json`),
    # never a half-written trace: traces are moved into place whole
    assert all(p.name.startswith(".pending-") for p in out.iterdir() if p != traces[0])
    replay = subprocess.run([sys.executable, "-m", "kvspec.cli", "replay", str(traces[0]),
                             "--target", target], capture_output=True, text=True,
                            timeout=300, env=env, cwd=tmp_path)
    assert replay.returncode == 1, (replay.stdout[-1500:], replay.stderr[-1500:])
    # Hypothesis writes its example database entry just after the trace is
    # saved; a kill landing between the two (seen once on loaded cores) loses
    # that entry, never the trace, which is what this test holds kvspec to
    # (tests/test_example_db.py checks what the database keeps).


def _traces(out: Path) -> list[Path]:
    return [p for p in out.glob("*.json") if not p.name.startswith(".")] if out.exists() else []


#: an interrupt caught after it escaped code run from a string (dataclasses,
#: attrs and typing build methods with ``exec`` of source, so an interrupt
#: landing during an import often lands there), then exit 130 as kvspec does
CAUGHT_IN_EXEC = """
import sys
from kvspec.harness.interrupt import forget_caught_interrupt
try:
    exec("raise KeyboardInterrupt", {})
except KeyboardInterrupt:
    print("kvspec: interrupted", file=sys.stderr)
if sys.argv[1:] == ["forget"]:
    forget_caught_interrupt()
sys.exit(130)
"""


@pytest.mark.parametrize("forget", [False, True])
def test_an_interrupt_caught_from_exec_code_still_exits_130(tmp_path, forget):
    """CPython 3.11 marks such an interrupt unhandled and kills the process
    with SIGINT at exit (-2, seen in CI about once in 20 runs of the moment
    0.0 above); ``forget_caught_interrupt``, which kvspec runs before exiting
    130, clears the mark. The first case shows the interpreter's behaviour the
    fix is for, so that the second cannot pass by accident."""
    (tmp_path / "caught.py").write_text(CAUGHT_IN_EXEC)
    proc = subprocess.run([sys.executable, "-m", "caught"] + (["forget"] if forget else []),
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    if forget:
        assert proc.returncode == 130, proc.stderr
    elif proc.returncode == 130:
        pytest.skip("this Python clears the mark itself (the fix is then a no-op)")
    else:
        assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stderr)


def test_an_interrupt_wrapped_by_a_library_is_an_interrupt():
    """``__set_name__`` during a class body turns a KeyboardInterrupt into a
    RuntimeError: still an interrupt (exit 130), not "unexpected RuntimeError"."""
    from kvspec.harness.interrupt import is_caused_by_interrupt
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as ki:
            raise RuntimeError("Error calling __set_name__") from ki
    except RuntimeError as exc:
        assert is_caused_by_interrupt(exc)
    assert not is_caused_by_interrupt(RuntimeError("x"))
