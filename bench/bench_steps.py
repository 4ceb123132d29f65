"""Steps per second of the reference scheduler, checked vs bare.

"checked": every step goes through ``kvspec.harness.runner.Runner`` (relations,
every invariant, the data oracle's worker model). "bare": the same target and
environment connector, stepped directly with a trivial worker (sampled tokens
only, no content model, no checks). Both run side by side in one process, so
their ratio is comparable; absolute numbers depend on the machine.

Workload: ``N`` concurrent requests (max_num_seqs = N), prompts of 16 tokens
whose first 8 tokens are one of 8 shared prefixes, ``max_tokens`` = 32; a
finished request is replaced at once so ``N`` requests stay alive.

    python bench/bench_steps.py                 # 5 s per configuration
    python bench/bench_steps.py --seconds 2 --concurrency 1 16
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path

from drivers import (BLOCK_SIZE, MAX_TOKENS, NUM_PREFIXES, PREFIX_LEN, PROMPT_LEN,
                     WARMUP_STEPS, BareDriver, CheckedDriver, git_commit, measure)

DEFAULT_OUT = Path(__file__).resolve().parent / "results.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0,
                    help="wall time per configuration and mode (default 5)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    rows = []
    for n in args.concurrency:
        bare = measure(lambda: BareDriver("impl", n, (1, 999)), args.seconds)
        checked = measure(lambda: CheckedDriver("impl", n, (1, 999)), args.seconds)
        ratio = checked["steps_per_s"] / bare["steps_per_s"] if bare["steps_per_s"] else None
        rows.append({"concurrency": n, "bare": bare, "checked": checked,
                     "checked_over_bare": round(ratio, 5) if ratio is not None else None})

    result = {
        "note": ("steps/s of the reference implementation; bare and checked were measured "
                 "side by side in one run, so ratios compare, absolute numbers depend on "
                 "the machine"),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "seconds_per_measurement": args.seconds,
        "warmup_steps": WARMUP_STEPS,
        "workload": {"block_size": BLOCK_SIZE, "prompt_len": PROMPT_LEN,
                     "shared_prefix_len": PREFIX_LEN, "num_prefixes": NUM_PREFIXES,
                     "max_tokens": MAX_TOKENS,
                     "max_num_batched_tokens": "max(4 * N, 64)",
                     "num_blocks": "N * ceil((prompt_len + max_tokens) / block_size) + N"},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print(f"{'N':>5}  {'bare steps/s':>13}  {'checked steps/s':>16}  {'checked/bare':>12}")
    for row in rows:
        ratio = row["checked_over_bare"]
        print(f"{row['concurrency']:>5}  {row['bare']['steps_per_s']:>13.2f}  "
              f"{row['checked']['steps_per_s']:>16.2f}  "
              f"{(f'{ratio:.4f}' if ratio is not None else 'n/a'):>12}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
