"""Throughput of ``kvspec fuzz --workers N`` against one worker (issue 28, item 4:
2 workers at least 1.7x one worker on 2 cores).

Side by side, interleaved repetition by repetition, each a fresh process in a fresh
directory (its own example database, so no run replays another's examples):
``kvspec fuzz --target impl --budget B --workers N --json`` for each N. The figure
is actions per second of the whole campaign (the workers' actions summed over the
campaign's wall time, start-up included), median over repetitions; the ratio is
N workers' median over one worker's. Runs after each other, never at once, so the
two settings never share the cores.

    python bench/bench_workers.py                    # 1 and 2 workers, 30 s, 3 repetitions
    python bench/bench_workers.py --workers 1 2 4 --budget 60s --reps 5

Writes ``bench/workers_results.json`` (machine, cores, date, git commit, every
repetition) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "workers_results.json"


def run_campaign(workers: int, budget: str, target: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "kvspec", "fuzz", "--target", target,
                               "--budget", budget, "--workers", str(workers), "--json"],
                              cwd=tmp, capture_output=True, text=True, timeout=3600,
                              env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT)))
        wall = time.monotonic() - started
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    return {"workers": workers, "exit": done.returncode, "wall_s": round(wall, 2),
            "runs": summary["runs"], "actions": summary["actions"],
            "actions_per_s": round(summary["actions"] / wall, 1)}


def get_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True)
    return out.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--budget", default="30s")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--target", default="impl")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rows: list[dict] = []
    for rep in range(args.reps):
        for n in args.workers:
            row = run_campaign(n, args.budget, args.target)
            rows.append(dict(row, rep=rep))
            print(f"rep {rep}: {n} worker(s): {row['actions']} actions in {row['wall_s']} s = "
                  f"{row['actions_per_s']} actions/s (exit {row['exit']})", file=sys.stderr)
    medians = {n: statistics.median(r["actions_per_s"] for r in rows if r["workers"] == n)
               for n in args.workers}
    base = medians[args.workers[0]]
    result = {"date": dt.date.today().isoformat(), "commit": get_commit(),
              "machine": platform.machine(), "cores": os.cpu_count(),
              "python": platform.python_version(), "target": args.target,
              "budget": args.budget, "reps": args.reps,
              "median_actions_per_s": {str(n): m for n, m in medians.items()},
              "ratio_to_one_worker": {str(n): round(m / base, 3) for n, m in medians.items()},
              "runs": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| workers | actions/s (median) | ratio |\n| --- | --- | --- |")
    for n, m in medians.items():
        print(f"| {n} | {m:.1f} | {m / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
