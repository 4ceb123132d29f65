"""A run cut short by SIGINT or SIGTERM (issue 28).

An interrupt stops a run; it is not a finding. Hypothesis tears a state
machine down in a ``finally``, so without care the teardown's healed phase
(drain every request to the end) would judge a step the interrupt left half
applied, and report a violation that replays clean: a cancelled CI job gone
red on correct code. While :func:`interruptible` is active, SIGINT and
SIGTERM set :data:`INTERRUPTED` before raising ``KeyboardInterrupt``; the
machine's teardown judges nothing once it is set, and the fuzzer returns the
partial result (exit 130), keeping every trace it had already saved.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

INTERRUPTED = threading.Event()
#: what stopped the run: "SIGINT", "SIGTERM", or TIME_LIMIT
_cause: list[str] = []
#: the cause of a stop at ``interruptible``'s own time limit (SIGALRM)
TIME_LIMIT = "time limit"


def is_interrupted() -> bool:
    return INTERRUPTED.is_set()


def is_caused_by_interrupt(exc: BaseException) -> bool:
    """An interrupt some library wrapped in its own error (``__set_name__``
    during a class body turns a KeyboardInterrupt into a RuntimeError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def forget_caught_interrupt() -> None:
    """Before exiting 130 after an interrupt that was caught: CPython (3.11)
    marks a KeyboardInterrupt that escapes code run from a string (``exec``
    of source: dataclasses, attrs and typing build methods that way, so an
    interrupt during an import lands there) as unhandled even when caught
    further up, and then kills the process with SIGINT at exit instead of
    exiting 130. Running any string clears the mark."""
    exec("pass", {})  # noqa: S102 (see the docstring)


def stop_if_interrupted() -> None:
    """Raise where the handler's own KeyboardInterrupt may have been lost:
    one raised inside a gc callback or ``__del__`` (Hypothesis runs one) is
    printed and dropped by Python, so the run checks the flag between steps."""
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt("interrupted")


def get_cause() -> str | None:
    """What stopped the last run: "SIGINT", "SIGTERM", ``TIME_LIMIT``; None."""
    return _cause[-1] if INTERRUPTED.is_set() and _cause else None


def _stop(signum, frame) -> None:
    name = signal.Signals(signum).name
    _cause[:] = [TIME_LIMIT if signum == signal.SIGALRM else name]
    INTERRUPTED.set()
    raise KeyboardInterrupt(name)


@contextlib.contextmanager
def interruptible(time_limit: float | None = None):
    """SIGINT and SIGTERM mark the run interrupted, then stop it (main thread
    only: signal handlers cannot be set elsewhere, and there the default
    KeyboardInterrupt of the main thread is all there is). ``time_limit``:
    seconds after which the run is stopped the same way, its cause
    ``TIME_LIMIT`` (a wall-clock safety net for a budget in runs)."""
    INTERRUPTED.clear()
    _cause.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stops = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGALRM,) if time_limit else ())
    previous = {s: signal.signal(s, _stop) for s in stops}
    if time_limit:
        signal.setitimer(signal.ITIMER_REAL, time_limit)
    hook = sys.unraisablehook

    def drop_lost_interrupt(unraisable) -> None:
        # the flag carries it (stop_if_interrupted): no traceback for the log
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            hook(unraisable)
    sys.unraisablehook = drop_lost_interrupt
    try:
        yield
    finally:
        if time_limit:
            signal.setitimer(signal.ITIMER_REAL, 0)
        sys.unraisablehook = hook
        for s, handler in previous.items():
            signal.signal(s, handler)
