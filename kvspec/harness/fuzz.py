"""Time-boxed fuzzing: Hypothesis batches under derived seeds until the budget
is spent or a counterexample is found. Every failure is written to a trace file
the moment it is seen (the last write is Hypothesis' shrunk example)."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Callable

import attrs
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import run_state_machine_as_test

from kvspec.harness.heartbeat import periodic
from kvspec.harness.machine import machine_for
from kvspec.harness.minimize import minimize
from kvspec.harness.profiles import FULL
from kvspec.harness.runner import ALL_KINDS, Counterexample
from kvspec.harness.trace import save_trace


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


def derive_seed(seed: int, batch: int) -> int:
    return (seed * 1_000_003 + batch * 7919) % (2 ** 32)


def safe_file_stem(target: str) -> str:
    """A target name as a file name a shell takes unquoted
    ("vllm?fixes=none&plant=a" -> "vllm-fixes-none-plant-a")."""
    return re.sub(r"[^A-Za-z0-9_.,-]+", "-", target.replace(":", "_")).strip("-")


def fuzz(target: str, budget: float, seed: int, out_dir: Path, db_dir: Path | None = None,
         batch_examples: int = 25, step_count: int = 30,
         progress: Callable[[FuzzResult], None] | None = None,
         kinds=ALL_KINDS, trace_name: str | None = None, profile=FULL,
         heartbeat: Callable[[FuzzResult], None] | None = None,
         heartbeat_every: float = 10.0, design_rules: bool = True,
         kv: str = "symbolic") -> FuzzResult:
    """Fuzz ``target`` for ``budget`` seconds. ``progress`` is called after each
    batch; ``kv``: the worker's KV, symbolic or torch (real tensors);
    ``heartbeat``, if given, every ``heartbeat_every`` seconds from a background
    thread with the counts so far (runs, actions), however long a batch takes."""
    start = time.monotonic()
    trace_path = out_dir / (trace_name or f"{safe_file_stem(target)}-seed{seed}.json")
    result = FuzzResult(target, seed, 0.0, 0, 0, {})
    state = {"last": None}

    def save(exc: Counterexample) -> None:
        r = exc.runner
        save_trace(trace_path, target=target, config=r.config, actions=list(r.actions),
                   violations=exc.violations, steps=r.log, seed=seed, kv=r.kv)

    def save_first(exc: Counterexample) -> None:
        if result.first_seen is None:
            result.first_seen = time.monotonic() - start
        save(exc)
        state["last"] = exc

    machine = machine_for(target, on_counterexample=save_first, kinds=kinds, profile=profile,
                          design_rules=design_rules, kv=kv)
    database = DirectoryBasedExampleDatabase(str(db_dir)) if db_dir else None
    stop = _start_heartbeat(heartbeat, heartbeat_every, machine, result, start)
    batch = 0
    try:
        while time.monotonic() - start < budget:
            machine._hypothesis_internal_use_seed = derive_seed(seed, batch)
            batch += 1
            try:
                run_state_machine_as_test(machine, settings=settings(
                    max_examples=batch_examples, stateful_step_count=step_count,
                    deadline=None, database=database, suppress_health_check=list(HealthCheck),
                    verbosity=Verbosity.quiet, print_blob=False,
                    phases=(Phase.reuse, Phase.generate, Phase.shrink)))
            except Exception:  # the machine raised: the saved trace holds the shrunk example
                if state["last"] is None:
                    raise
                # Minimize Hypothesis' shrunk example at the trace level; the saved
                # trace is replaced only by a smaller one that still fails.
                result.counterexample = minimize(target, state["last"], kinds,
                                                 design_rules=design_rules)
                if result.counterexample is not state["last"]:
                    save(result.counterexample)
                result.trace_path = trace_path
                break
            finally:
                _collect(result, machine, start)
                if progress:
                    progress(result)
    finally:
        stop.set()
    return result


def _start_heartbeat(heartbeat, every: float, machine, result: FuzzResult,
                     start: float) -> threading.Event:
    """Call ``heartbeat`` every ``every`` seconds until the returned event is set."""
    if heartbeat is None:
        return periodic(None, every)

    def beat() -> None:
        stats = machine.stats  # the fuzzing thread's Counter; single reads are atomic
        heartbeat(FuzzResult(result.target, result.seed, time.monotonic() - start,
                             stats["runs"], stats["actions"], {}))
    return periodic(beat, every)


def _collect(result: FuzzResult, machine, start: float) -> None:
    stats = machine.stats
    result.elapsed = time.monotonic() - start
    result.runs = stats["runs"]
    result.actions = stats["actions"]
    result.checks = _prefixed(stats, "check:")
    result.witnessed = _prefixed(stats, "witness:")
    result.features = _prefixed(stats, "feature:")


def _prefixed(stats, prefix: str) -> dict[str, int]:
    return {k[len(prefix):]: v for k, v in stats.items() if k.startswith(prefix)}
