"""Time every Z3 obligation (`kvspec prove`) and the bounded model checker on
the reference and on every mutant; write bench/prove_results.json.

Run pinned to one core for the figure the issue asks for:
    taskset -c 0 python bench/bench_prove.py
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import z3

from kvspec.harness.bmc import bmc
from kvspec.impl.mutants import MUTANTS
from kvspec.spec.prove import check_all

OUT = Path(__file__).with_name("prove_results.json")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def main(depth: int = 7) -> None:
    start = time.perf_counter()
    results = check_all()
    prove_seconds = time.perf_counter() - start
    bmc_rows = []
    for target in ["impl"] + [f"mutant:{m}" for m in MUTANTS]:
        r = bmc(target, depth=depth)
        ce = r.counterexample
        bmc_rows.append({"target": target, "depth": depth, "states": r.states,
                         "seconds": round(r.seconds, 3), "exhausted": r.exhausted,
                         "found": sorted({v.invariant for v in ce.violations}) if ce else None,
                         "trace_actions": len(ce.runner.actions) if ce else None})
        print(f"bmc {target}: {bmc_rows[-1]}")
    payload = {
        "note": "one process; run under `taskset -c 0` for the one-core figure",
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "python": platform.python_version(), "z3": z3.get_version_string(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "prove": {"obligations": len(results), "all_ok": all(r.ok for r in results),
                  "total_seconds": round(prove_seconds, 3),
                  "by_kind_seconds": {k: round(sum(r.seconds for r in results if r.kind == k), 3)
                                      for k in ("lemma", "refutation", "induction")},
                  "slowest": sorted(({"name": r.name, "seconds": round(r.seconds, 4)}
                                     for r in results), key=lambda d: -d["seconds"])[:5],
                  "per_obligation": {r.name: round(r.seconds, 4) for r in results}},
        "bmc": bmc_rows,
    }
    OUT.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"prove: {len(results)} obligations in {prove_seconds:.2f}s; wrote {OUT}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
