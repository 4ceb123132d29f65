"""Where a checked step's time goes: every claim timed, and the rest profiled.

Issue 30 asks that each claim's cost be visible before checking is made
incremental. The workload is bench_steps.py's (``drivers.py``): ``N`` live
requests on the reference implementation, stepped through the checking
Runner. Per concurrency it records steps/s, the seconds spent in each claim
(per step and as a share of the step), and, from cProfile over a second run of
the same length, kvspec's functions that cost most by own time (the claims'
helpers, the observation, the data oracle, the worker model). Shares, not absolute
times, are what compares across machines; cProfile slows every call, so its
table ranks costs, it does not measure them.

    python bench/bench_claims.py                    # 5 s per concurrency
    python bench/bench_claims.py --seconds 2 --concurrency 1 16
"""
from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path

from drivers import (PRODUCTION, SMALL, WARMUP_STEPS, WORKLOADS, CheckedDriver, Shape,
                     environment, parse_args)

from kvspec.harness import checker

DEFAULT_OUT = Path(__file__).resolve().parent / "claims_results.json"
TOP = 10


def run_for(driver: CheckedDriver, seconds: float) -> tuple[int, float]:
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        driver.step()
        steps += 1
    return steps, time.perf_counter() - start


def warmed_up(n: int, shape: Shape) -> CheckedDriver:
    """A checked driver past its first steps (all prefill), untimed."""
    driver = CheckedDriver("impl", n, (1, 999), shape)
    for _ in range(WARMUP_STEPS):
        driver.step()
    return driver


def measure_claims(n: int, seconds: float, shape: Shape) -> dict:
    driver = warmed_up(n, shape)
    checker.start_profile()
    steps, elapsed = run_for(driver, seconds)
    costs = checker.stop_profile()
    in_claims = sum(t for _, t in costs.values())
    rows = sorted(costs.items(), key=lambda kv: -kv[1][1])
    return {
        "workload": shape.name, "concurrency": n, "steps": steps,
        "seconds": round(elapsed, 3),
        "steps_per_s": round(steps / elapsed, 2),
        "ms_per_step": round(elapsed / steps * 1e3, 3),
        "claims_share_of_step": round(in_claims / elapsed, 4),
        "costliest_claims": [
            {"claim": name, "us_per_step": round(t / steps * 1e6, 1),
             "us_per_evaluation": round(t / k * 1e6, 1),
             "share_of_step": round(t / elapsed, 4), "evaluations": k}
            for name, (k, t) in rows[:TOP]],
    }


def profile_functions(n: int, seconds: float, shape: Shape) -> list[dict]:
    """kvspec's functions by own time under cProfile (the claims' helpers, the
    observation, the data oracle, the worker model), as a share of all time."""
    driver = warmed_up(n, shape)
    profiler = cProfile.Profile()
    profiler.enable()
    run_for(driver, seconds)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    total = sum(tt for (_, _, tt, _, _) in stats.values())
    rows = [(f"{Path(file).parent.name}/{Path(file).name}:{line} {name}", tt)
            for (file, line, name), (_, _, tt, _, _) in stats.items()
            if "kvspec" in file or "/spec/" in file or "/impl/" in file]
    rows.sort(key=lambda r: -r[1])
    return [{"function": f, "share_of_profiled_time": round(tt / total, 4)}
            for f, tt in rows[:TOP]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, DEFAULT_OUT, argv)
    rows = []
    runs = [(n, SMALL) for n in args.concurrency] + \
        ([(args.production, PRODUCTION)] if args.production else [])
    for n, shape in runs:
        row = measure_claims(n, args.seconds, shape)
        row["costliest_functions"] = profile_functions(n, args.seconds, shape)
        rows.append(row)
        top = ", ".join(f"{c['claim']} {c['share_of_step']:.1%}"
                        for c in row["costliest_claims"][:3])
        print(f"{shape.name} N={n:>3}: {row['steps_per_s']:>9.2f} checked steps/s, claims "
              f"{row['claims_share_of_step']:.0%} of a step; costliest: {top}")
    result = {"note": ("time inside each claim while the reference implementation is "
                       "stepped through the checking Runner; shares compare across "
                       "machines, absolute times do not"),
              **environment(args.seconds), "workloads": WORKLOADS, "results": rows}
    import json
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
