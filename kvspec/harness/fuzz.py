"""Time-boxed fuzzing: Hypothesis batches under derived seeds until the budget
is spent or a new counterexample is found. Every failure is written to a trace
file the moment it is seen, before anything else happens (the last write is
Hypothesis' shrunk example).

The budget bounds the wall time, shrinking included: once it is spent, every
action is skipped (``KVSpecMachine.deadline``), so shrinking stops and the
smallest counterexample found so far is the one kept.

A counterexample that a known finding explains (``kvspec.harness.known``) is
reported as that finding, its first trace kept under ``known/``, and fuzzing
goes on: the environment is never narrowed around a known finding.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable
from unittest import SkipTest

import attrs
import hypothesis.internal.conjecture.engine as hypothesis_engine
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.harness.example_db import open_database
from kvspec.harness.heartbeat import periodic
from kvspec.harness.interrupt import (INTERRUPTED, TIME_LIMIT, get_cause, interruptible,
                                      is_interrupted, stop_if_interrupted)
from kvspec.harness.machine import SCALES, machine_for
from kvspec.harness.minimize import minimize
from kvspec.harness.profiles import MODELLED
from kvspec.harness.runner import ALL_KINDS, Counterexample, is_lost_performance
from kvspec.harness.trace import save_trace

PHASES = (Phase.reuse, Phase.generate, Phase.shrink)
#: an examples budget does not replay the database first: what earlier runs found
#: must not change what this seed explores
PHASES_BY_EXAMPLES = (Phase.generate, Phase.shrink)


@attrs.define
class FuzzResult:
    target: str
    seed: int
    elapsed: float
    runs: int
    actions: int
    checks: dict[str, int]
    counterexample: Counterexample | None = None
    trace_path: Path | None = None
    first_seen: float | None = None
    #: claim -> how often its antecedent held (a request was in the state it speaks about)
    witnessed: dict[str, int] = attrs.Factory(dict)
    #: environment feature -> steps that exercised it (kvspec.harness.runner.FEATURES)
    features: dict[str, int] = attrs.Factory(dict)
    #: state checks that judged only what a call changed ("incremental") and
    #: those that judged everything ("full": first ones, the interval, run ends)
    state_checks: dict[str, int] = attrs.Factory(dict)
    #: runs per size ("small", "production": ``machine.ProductionMachine``)
    scales: dict[str, int] = attrs.Factory(dict)
    #: known findings met on the way (``Explanation.key`` -> KnownHit)
    known: dict[str, "KnownHit"] = attrs.Factory(dict)
    #: efficiency claims broken on the way (claim -> KnownHit): lost performance,
    #: reported apart; the run goes on and the safety verdict is not touched
    efficiency: dict[str, "KnownHit"] = attrs.Factory(dict)
    #: seconds into the run when shrinking the new counterexample began
    shrink_started: float | None = None
    #: the budget ran out while the counterexample was being shrunk
    shrink_cut: bool = False
    #: SIGINT or SIGTERM stopped the run: what it shows is partial, and
    #: nothing after the interrupt was judged (kvspec.harness.interrupt)
    interrupted: bool = False
    #: what interrupted it: "SIGINT" or "SIGTERM"
    interrupted_by: str | None = None
    #: the wall-clock ``time_limit`` of a budget in runs stopped the run
    #: before its runs were done (judged up to there, like an interrupt)
    time_limited: bool = False
    #: the budget in runs asked for (None: a budget in seconds), and its
    #: wall-clock safety net in seconds (None: none)
    max_examples: int | None = None
    time_limit: float | None = None
    #: the saved trace replayed again: (how many replays broke one of its claims,
    #: how many replays); fewer than all is a flaky verdict
    replays: tuple[int, int] | None = None


@attrs.define
class KnownHit:
    """A known finding met during a run: how often, how it was recognised, and
    the first trace that showed it."""

    finding: str | None
    how: str
    upstream: str
    claims: list[str]
    count: int = 0
    trace_path: Path | None = None
    #: actions in the kept trace
    length: int = 0
    #: the finding, or what it is when no one finding is named
    label: str = ""
    #: seconds into the run when it was first met, and the rows of its kept trace
    seen_s: float | None = None
    rows: int = 0


def derive_seed(seed: int, batch: int) -> int:
    return (seed * 1_000_003 + batch * 7919) % (2 ** 32)


#: seconds of trace-level minimization a failure gets even past the budget
MINIMIZE_AT_LEAST_S = 5.0


#: the longest stem a trace's file name takes from a target name: file systems
#: refuse names over 255 bytes, and ``vllm?fixes=`` with a dozen fixes is longer
MAX_STEM = 80


def safe_file_stem(target: str) -> str:
    """A target name as a file name a shell takes unquoted
    ("vllm?fixes=none&plant=a" -> "vllm-fixes-none-plant-a"); a long one cut
    short and told apart by a hash of the whole name."""
    stem = re.sub(r"[^A-Za-z0-9_.,-]+", "-", target.replace(":", "_")).strip("-")
    if len(stem) <= MAX_STEM:
        return stem
    digest = hashlib.sha256(target.encode()).hexdigest()[:12]
    return f"{stem[:MAX_STEM - 13].rstrip('-,.')}-{digest}"


@contextlib.contextmanager
def lift_shrink_time_cap(lift: bool):
    """Hypothesis stops shrinking after ``MAX_SHRINKING_SECONDS`` (300) of wall
    time, so a slow machine may report a less shrunk example than a fast one;
    an examples budget promises the same trace on any machine, so it lifts the
    cap for its batches (Hypothesis leaves the constant patchable for this)."""
    if not lift:
        yield
        return
    kept = hypothesis_engine.MAX_SHRINKING_SECONDS
    hypothesis_engine.MAX_SHRINKING_SECONDS = math.inf
    try:
        yield
    finally:
        hypothesis_engine.MAX_SHRINKING_SECONDS = kept


def fuzz(target: str, budget: float, seed: int, out_dir: Path, db_dir: Path | None = None,
         batch_examples: int = 25, step_count: int = 30,
         progress: Callable[[FuzzResult], None] | None = None,
         kinds=ALL_KINDS, trace_name: str | None = None, profile=MODELLED,
         heartbeat: Callable[[FuzzResult], None] | None = None,
         heartbeat_every: float = 10.0, design_rules: bool = True,
         kv: str = "symbolic", recogniser=None,
         on_event: Callable[[str], None] | None = None,
         on_run: Callable[[int], None] | None = None,
         max_examples: int | None = None, scale: str = "small",
         time_limit: float | None = None) -> FuzzResult:
    """Fuzz ``target`` for ``budget`` seconds, shrinking included. ``progress``
    is called after each batch; ``kv``: the worker's KV, symbolic or torch (real
    tensors); ``heartbeat``, if given, every ``heartbeat_every`` seconds from a
    background thread with the counts so far (runs, actions), however long a
    batch takes. ``recogniser``: a ``known.Recogniser`` (None: every
    counterexample is new); ``on_event``: one-line news (a known finding met,
    shrinking begun); ``on_run``: called as each run starts (coverage contexts).
    ``max_examples``: a budget in runs instead of seconds, so that a seed explores
    the same way on any machine: no time limit applies (to shrinking neither:
    ``lift_shrink_time_cap``), generation stops at the first failure, and the
    example database is written but not replayed first. ``scale``: "small"
    runs, "production"-sized ones (``machine.ProductionMachine``), or "mixed":
    one batch in ``PRODUCTION_EVERY`` is ``PRODUCTION_BATCH`` production-sized runs.
    ``time_limit``: with ``max_examples``, seconds of wall clock after which the
    run stops as an interrupt would (``FuzzResult.time_limited``), a safety net
    for a CI job's timeout; an examples budget that ends sooner is unaffected."""
    if time_limit is not None and max_examples is None:
        raise ValueError("time_limit applies to a budget in runs (max_examples)")
    start = time.monotonic()
    by_examples = max_examples is not None
    deadline = math.inf if by_examples else start + budget
    trace_path = out_dir / (trace_name or f"{safe_file_stem(target)}-seed{seed}.json")
    pending = trace_path.with_name(f".pending-{trace_path.name}")
    result = FuzzResult(target, seed, 0.0, 0, 0, {}, max_examples=max_examples,
                        time_limit=time_limit)
    state = {"last": None}
    say = on_event or (lambda _line: None)

    def save(exc: Counterexample, path: Path) -> None:
        r = exc.runner
        save_trace(path, target=target, config=r.config, actions=list(r.actions),
                   violations=exc.violations, steps=r.log, seed=seed, kv=r.kv)

    def explain(exc: Counterexample):
        if recogniser is None or not recogniser.is_active:
            return None
        r = exc.runner
        return recogniser.explain(r.config, list(r.actions), exc.violations, rows=len(r.log))

    def on_counterexample(exc: Counterexample) -> bool:
        if is_interrupted():  # a step the interrupt cut short: not a finding
            return True
        save(exc, pending)  # first: nothing found is lost, whatever follows
        if is_efficiency_only(exc):
            _keep_efficiency(result, exc, pending, out_dir, trace_path.stem, say,
                             time.monotonic() - start)
            return True
        why = explain(exc)
        if why is not None:
            _keep_known(result, why, exc, pending, out_dir, trace_path.stem, say)
            return True
        if result.first_seen is None:
            result.first_seen = time.monotonic() - start
            result.shrink_started = result.first_seen
            left = max(0.0, deadline - time.monotonic())
            limit = ("to the end (an examples budget)" if by_examples else
                     f"for at most {left:.0f}s (the rest of the budget)")
            say(f"new counterexample ({', '.join(sorted({v.invariant for v in exc.violations}))}"
                f") at {result.first_seen:.1f}s; shrinking it {limit}")
        os.replace(pending, trace_path)
        state["last"] = exc
        return False

    if scale not in SCALES:
        raise ValueError(f"scale {scale!r}: one of {', '.join(SCALES)}")
    stats = Counter()  # one count for the small and the production-sized runs
    machines = {size: machine_for(target, on_counterexample=on_counterexample, kinds=kinds,
                                  profile=profile, design_rules=design_rules, kv=kv,
                                  deadline=None if by_examples else deadline, scale=size,
                                  stats=stats)
                for size in ("small", "production")}
    machine = machines["small"]
    if on_run is not None:
        for m in machines.values():
            _tell_run_starts(m, on_run)
    database = open_database(db_dir)  # a directory, redis://, github-artifact:
    stop = _start_heartbeat(heartbeat, heartbeat_every, machine, result, start)
    batch = planned = 0  # batches begun, runs asked of them
    # a production-sized failure the database keeps is tried first, not at the
    # first production batch (one in PRODUCTION_EVERY): a short check meets it
    reuse_first = scale == "mixed" and database is not None and not by_examples
    try:
        with interruptible(time_limit):
            while (planned < max_examples if by_examples
                   else time.monotonic() < deadline):
                stop_if_interrupted()
                phases = PHASES_BY_EXAMPLES if by_examples else PHASES
                machine_seed = derive_seed(seed, batch)
                if reuse_first:
                    size, phases, reuse_first = "production", (Phase.reuse,), False
                else:
                    size = get_batch_scale(scale, batch)
                    batch += 1
                machine = machines[size]
                machine._hypothesis_internal_use_seed = machine_seed
                examples = batch_examples if size == "small" else PRODUCTION_BATCH
                if by_examples:
                    examples = min(examples, max_examples - planned)
                planned += examples if Phase.generate in phases else 0
                try:
                    with lift_shrink_time_cap(by_examples):
                        run_state_machine_as_test(machine, settings=settings(
                            max_examples=examples, stateful_step_count=step_count,
                            deadline=None, database=database,
                            suppress_health_check=list(HealthCheck),
                            verbosity=Verbosity.quiet, print_blob=False, phases=phases,
                            # Hypothesis goes on generating for up to 10 s of wall
                            # time after a first failure: an examples budget stops
                            # at it, so that no machine's speed changes what is shrunk
                            report_multiple_bugs=not by_examples))
                except SkipTest:  # a reuse-only batch with nothing saved: nothing ran
                    pass
                except Exception:  # the machine raised: the saved trace holds the shrunk example
                    # an interrupt Hypothesis' engine turned into its own error (one
                    # landing before its runner exists trips `assert state._runner`)
                    stop_if_interrupted()
                    if state["last"] is None:
                        raise
                    result.shrink_cut = time.monotonic() > deadline
                    # Minimize Hypothesis' shrunk example at the trace level; the saved
                    # trace is replaced only by a smaller one that still fails (and is
                    # still new), within what is left of the budget, but at least
                    # MINIMIZE_AT_LEAST_S: a budget spent shrinking otherwise left the
                    # reader a trace of 30-40 actions that a few seconds cut to 5
                    result.counterexample = minimize(
                        target, state["last"], kinds, design_rules=design_rules,
                        time_limit=(math.inf if by_examples else
                                    max(MINIMIZE_AT_LEAST_S,
                                        min(20.0, deadline - time.monotonic()))),
                        still_new=lambda found: explain(found) is None)
                    if result.counterexample is not state["last"]:
                        save(result.counterexample, trace_path)
                    result.trace_path = trace_path
                    result.replays = count_failing_replays(
                        trace_path, target, {v.invariant for v in result.counterexample.violations})
                    break
                finally:
                    _collect(result, machine, start)
                    if progress:
                        progress(result)
            stop_if_interrupted()
    except KeyboardInterrupt:
        if get_cause() == TIME_LIMIT:
            result.time_limited = True
            result.shrink_cut = result.counterexample is None and state["last"] is not None
            INTERRUPTED.clear()  # what follows (a review's replays) runs as usual
        else:
            result.interrupted, result.interrupted_by = True, get_cause()
        # found and saved before the interrupt: kept (minimized already, if the
        # interrupt came after minimize)
        if result.counterexample is None and state["last"] is not None:
            result.counterexample, result.trace_path = state["last"], trace_path
    finally:
        stop.set()
        pending.unlink(missing_ok=True)
    return result


#: under ``scale="mixed"``, one batch in this many is production-sized ...
PRODUCTION_EVERY = 16
#: ... and runs this many runs: a production-sized run takes seconds, a small one
#: tens of milliseconds. (Hypothesis begins every batch with its simplest example,
#: the same each time: a batch of one would run nothing else.)
PRODUCTION_BATCH = 4


def get_batch_scale(scale: str, batch: int) -> str:
    """The size of the runs of ``batch`` (0-based) under ``scale``."""
    if scale == "mixed":
        return "production" if batch % PRODUCTION_EVERY == PRODUCTION_EVERY - 1 else "small"
    return scale


def _tell_run_starts(machine, on_run: Callable[[int], None]) -> None:
    original_init = machine.__init__

    def init(self) -> None:
        on_run(type(self).stats["runs"] + 1)
        original_init(self)
    machine.__init__ = init


#: how often a new counterexample's saved trace is replayed before it is reported
REPLAYS = 3


def count_failing_replays(path: Path, target: str, claims: set[str], times: int = REPLAYS,
                          replay=None) -> tuple[int, int]:
    """How many of ``times`` replays of the saved trace break one of ``claims``:
    a verdict that does not reproduce every time is reported as flaky (a data
    race, an unseeded random choice, a dependence on the wall clock), not as a
    plain violation. A replay that cannot run at all counts as not failing."""
    if replay is None:
        from kvspec.harness.replay import replay_trace as replay
    failed = 0
    for _ in range(times):
        try:
            outcome = replay(path, target)
        except Exception:  # noqa: BLE001 (reported by the count, and by `kvspec replay`)
            continue
        failed += bool(claims & {v.invariant for v in outcome.violations})
    return failed, times


def _keep_known(result: FuzzResult, why, exc: Counterexample, pending: Path, out_dir: Path,
                stem: str, say: Callable[[str], None]) -> None:
    """Count a known finding; keep its first trace (and a shorter one later).
    Not while a new counterexample is being shrunk: its candidates are not runs
    (the recogniser still decides that such a candidate is not the new one)."""
    if result.first_seen is not None:
        pending.unlink(missing_ok=True)
        return
    hit = result.known.get(why.key)
    claims = sorted({v.invariant for v in exc.violations})
    if hit is None:
        hit = result.known[why.key] = KnownHit(why.finding, why.how, why.upstream, claims,
                                               label=why.key)
        say(f"known: {why.key}: {why.how}; the run goes on")
    hit.count += 1
    _keep_shortest_trace(hit, exc, pending,
                         out_dir / "known" / f"{safe_file_stem(why.key)}-{stem}.json")


def _keep_shortest_trace(hit: KnownHit, exc: Counterexample, pending: Path, path: Path) -> None:
    """Move the pending trace to ``path`` if it is the hit's first or shorter
    than the one kept; drop it otherwise."""
    if hit.trace_path is None or len(exc.runner.actions) < hit.length:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(pending, path)
        hit.trace_path, hit.length = path, len(exc.runner.actions)
        hit.rows = len(exc.runner.log)
    else:
        pending.unlink(missing_ok=True)


def is_efficiency_only(exc: Counterexample) -> bool:
    """Every claim broken is of role "efficiency": work lost, nothing corrupted
    (a run reports those at its end, ``Runner.lost``; they never stop it)."""
    return all(is_lost_performance(v) for v in exc.violations)


def _keep_efficiency(result: FuzzResult, exc: Counterexample, pending: Path, out_dir: Path,
                     stem: str, say: Callable[[str], None], seen_s: float) -> None:
    """Count lost performance per claim; keep its first trace (a shorter one later).
    Not while a new counterexample is being shrunk: its candidates are not runs."""
    if result.first_seen is not None:
        pending.unlink(missing_ok=True)
        return
    claims = sorted({v.invariant for v in exc.violations})
    key = "+".join(claims)
    hit = result.efficiency.get(key)
    if hit is None:
        message = exc.violations[0].message
        hit = result.efficiency[key] = KnownHit(None, message, "", claims, label=key,
                                                seen_s=seen_s)
        say(f"lost performance: {key}: {message}; the run goes on")
    hit.count += 1
    _keep_shortest_trace(hit, exc, pending,
                         out_dir / "efficiency" / f"{safe_file_stem(key)}-{stem}.json")


def _start_heartbeat(heartbeat, every: float, machine, result: FuzzResult,
                     start: float) -> threading.Event:
    """Call ``heartbeat`` every ``every`` seconds until the returned event is set."""
    if heartbeat is None:
        return periodic(None, every)

    def beat() -> None:
        stats = machine.stats  # the fuzzing thread's Counter; single reads are atomic
        heartbeat(FuzzResult(result.target, result.seed, time.monotonic() - start,
                             stats["runs"], stats["actions"], {},
                             shrink_started=result.shrink_started))
    return periodic(beat, every)


def _collect(result: FuzzResult, machine, start: float) -> None:
    stats = machine.stats
    result.elapsed = time.monotonic() - start
    result.runs = stats["runs"]
    result.actions = stats["actions"]
    result.checks = _prefixed(stats, "check:")
    result.witnessed = _prefixed(stats, "witness:")
    result.features = _prefixed(stats, "feature:")
    result.state_checks = _prefixed(stats, "state_checks:")
    result.scales = _prefixed(stats, "scale:")


def _prefixed(stats, prefix: str) -> dict[str, int]:
    return {k[len(prefix):]: v for k, v in stats.items() if k.startswith(prefix)}
