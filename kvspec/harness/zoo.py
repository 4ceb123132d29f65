"""The bug zoo: run every mutant, record who caught it, how fast, and how short
the shrunk counterexample is; then the same with the data oracle alone."""
from __future__ import annotations

import shutil
from pathlib import Path

import attrs

from kvspec.harness.fuzz import fuzz
from kvspec.impl.mutants import MUTANTS, PENDING_MUTANTS


@attrs.define
class Detection:
    caught: bool
    invariants: list[str]
    seconds: float | None   # time to the first failing example
    total_seconds: float    # including shrinking
    steps: int | None       # rows in the shrunk step table
    trace: str | None


@attrs.define
class ZooRow:
    name: str
    description: str
    upstream: str
    expected: str
    status: str                         # "caught", "survived" or "pending"
    full: Detection | None = None
    oracle_alone: Detection | None = None


def detect(target: str, budget: float, seed: int, out_dir: Path, kinds=None, tag="",
           **fuzz_options) -> Detection:
    kwargs = {"kinds": kinds} if kinds else {}
    name = f"{target.replace(':', '_')}{tag}.json"
    result = fuzz(target, budget, seed, out_dir, trace_name=name, **kwargs, **fuzz_options)
    ce = result.counterexample
    lost = next(iter(result.efficiency.values()), None)
    if ce is None and lost is not None:  # an efficiency mutant: lost performance
        return Detection(True, lost.claims, lost.seen_s, result.elapsed, lost.rows,
                         str(lost.trace_path))
    if ce is None:
        return Detection(False, [], None, result.elapsed, None, None)
    invariants = sorted({v.invariant for v in ce.violations})
    return Detection(True, invariants, result.first_seen, result.elapsed, len(ce.runner.log),
                     str(result.trace_path))


def run_zoo(budget: float, seed: int, out_dir: Path, names=None, oracle_alone=True,
            regressions: Path | None = None, progress=None, heartbeat=None,
            heartbeat_every: float = 10.0) -> list[ZooRow]:
    """``progress`` is called with each row; ``heartbeat`` as fuzz() calls it."""
    rows = []
    beat = {"heartbeat": heartbeat, "heartbeat_every": heartbeat_every}
    for name, mutant in MUTANTS.items():
        if names and name not in names:
            continue
        full = detect(f"mutant:{name}", budget, seed, out_dir, **beat)
        alone = detect(f"mutant:{name}", budget, seed, out_dir, kinds=("data",),
                       tag="-oracle", **beat) if oracle_alone else None
        row = ZooRow(name, mutant.description, mutant.upstream, mutant.expected_invariant,
                     "caught" if full.caught else "survived", full, alone)
        if regressions is not None and full.trace:
            regressions.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(full.trace, regressions / f"{name}.json")
        rows.append(row)
        if progress:
            progress(row)
    for name, (description, upstream) in PENDING_MUTANTS.items():
        if not names or name in names:
            rows.append(ZooRow(name, description, upstream, "-", "pending"))
    return rows
