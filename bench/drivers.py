"""The workload and the two ways of stepping a target that the benchmarks
compare side by side: through the checking Runner, and bare."""
from __future__ import annotations

import argparse
import random
import subprocess
import time
from pathlib import Path

import attrs

from kvspec.gc_policy import describe_collector, tune_collector
from kvspec.harness.env import EnvConnector, RequestSpec, sampled_token
from kvspec.harness.runner import ALL_KINDS, Runner
from kvspec.harness.target import make_config
from kvspec.harness.targets import make_target
from kvspec.spec.oracle import KVContent
from kvspec.spec.state import WorkerOutcome

WARMUP_STEPS = 8
REPO = Path(__file__).resolve().parents[1]

# the collector as the ``kvspec`` command sets it, for the bare and the
# checked runs alike (kvspec/gc_policy.py)
tune_collector()


@attrs.frozen
class Shape:
    """The requests and pool of one benchmark workload."""

    name: str
    block_size: int
    prompt_len: int
    #: the first ``prefix_len`` tokens of a prompt are one of ``num_prefixes`` shared ones
    prefix_len: int
    num_prefixes: int
    max_tokens: int
    #: None: just enough for ``N`` requests to run to the end, plus one block each
    num_blocks: int | None = None
    #: None: ``max(4 N, 64)``
    max_num_batched_tokens: int | None = None

    def get_num_blocks(self, n: int) -> int:
        blocks_per_seq = -(-(self.prompt_len + self.max_tokens) // self.block_size)
        return self.num_blocks or n * blocks_per_seq + n

    def describe(self) -> dict:
        return {"name": self.name, "block_size": self.block_size,
                "prompt_len": self.prompt_len, "shared_prefix_len": self.prefix_len,
                "num_prefixes": self.num_prefixes, "max_tokens": self.max_tokens,
                "max_model_len": self.prompt_len + self.max_tokens + self.block_size,
                "max_num_batched_tokens": self.max_num_batched_tokens or "max(4 * N, 64)",
                "num_blocks": self.num_blocks or
                "N * ceil((prompt_len + max_tokens) / block_size) + N"}


#: the small workload every concurrency runs (the fuzzer's scale)
SMALL = Shape("small", block_size=4, prompt_len=16, prefix_len=8, num_prefixes=8, max_tokens=32)
#: issue 30's production-sized configuration: vLLM's default block size and
#: chunked-prefill budget, 2,000-token prompts sharing 1,000-token prefixes,
#: a 10,000-block pool
PRODUCTION = Shape("production", block_size=16, prompt_len=2000, prefix_len=1000,
                   num_prefixes=8, max_tokens=32, num_blocks=10_000,
                   max_num_batched_tokens=8192)
#: how many requests the production row keeps alive
PRODUCTION_CONCURRENCY = 64


def bench_config(n: int, shape: Shape = SMALL):
    return make_config(block_size=shape.block_size, num_blocks=shape.get_num_blocks(n),
                       max_num_batched_tokens=shape.max_num_batched_tokens or max(n * 4, 64),
                       max_num_seqs=n,
                       max_model_len=shape.prompt_len + shape.max_tokens + shape.block_size)


class Workload:
    """Deterministic stream of requests sharing a few prefixes."""

    def __init__(self, token_range: tuple[int, int], shape: Shape = SMALL, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.token_range, self.shape = token_range, shape
        self.prefixes = [self._draw(shape.prefix_len) for _ in range(shape.num_prefixes)]
        self.count = 0

    def _draw(self, n: int) -> list[int]:
        """``n`` tokens drawn uniformly from the range (``choices``: a fraction
        of ``randint``'s cost, which at 1,000 tokens per production request was
        about a millisecond per step, in the bare and the checked runs alike)."""
        lo, hi = self.token_range
        return self.rng.choices(range(lo, hi + 1), k=n)

    def next(self) -> tuple[str, list[int]]:
        rid = f"r{self.count}"
        prefix = self.prefixes[self.count % self.shape.num_prefixes]
        suffix = self._draw(self.shape.prompt_len - self.shape.prefix_len)
        self.count += 1
        return rid, prefix + suffix


class _Driver:
    """Keeps ``n`` requests of the workload alive; subclasses say how one is added."""

    def __init__(self, n: int, token_range: tuple[int, int], shape: Shape = SMALL) -> None:
        self.workload = Workload(token_range, shape)
        self.live: set[str] = set()
        self.n, self.shape = n, shape

    def _top_up(self) -> None:
        while len(self.live) < self.n:
            rid, prompt = self.workload.next()
            self._add(rid, prompt)
            self.live.add(rid)

    def _add(self, rid: str, prompt: list[int]) -> None:
        raise NotImplementedError


class CheckedDriver(_Driver):
    """Steps through the Runner: every relation, invariant and the data oracle."""

    def __init__(self, target: str, n: int, token_range: tuple[int, int],
                 shape: Shape = SMALL, kinds=ALL_KINDS) -> None:
        super().__init__(n, token_range, shape)
        self.runner = Runner(target, bench_config(n, shape), kinds)

    def _add(self, rid: str, prompt: list[int]) -> None:
        self.runner.apply({"op": "add", "id": rid, "prompt": prompt,
                           "max_tokens": self.shape.max_tokens})

    def step(self) -> None:
        self._top_up()
        self.runner.apply({"op": "step"})
        del self.runner.log[:-64], self.runner.actions[:-64]  # keep memory flat
        self.live &= set(self.runner.obs.requests)


class BareDriver(_Driver):
    """The same target and connector, stepped directly: no checks, no oracle."""

    def __init__(self, target: str, n: int, token_range: tuple[int, int],
                 shape: Shape = SMALL) -> None:
        super().__init__(n, token_range, shape)
        cfg = bench_config(n, shape)
        content = KVContent(cfg.num_blocks, cfg.block_size)
        self.env = EnvConnector(content, lambda rid: self.target.observe_request(rid))
        self.target = make_target(target, cfg, self.env)
        self.requests = self.target.scheduler.requests

    def _add(self, rid: str, prompt: list[int]) -> None:
        spec = RequestSpec(rid, tuple(prompt), self.shape.max_tokens)
        self.env.plan(spec)
        self.target.add_request(spec)

    def step(self) -> None:
        self._top_up()
        step = self.target.schedule()
        self.target.update_from_output(self._sample(step))
        self.live = {rid for rid in self.live if rid in self.requests}

    def _sample(self, step) -> WorkerOutcome:
        """The trivial worker: a token for each request whose scheduled tokens
        reach its end, nothing else."""
        sampled = {}
        for rid, n in step.num_scheduled_tokens.items():
            num_tokens = self.requests[rid].num_tokens
            if step.num_computed_before[rid] + n >= num_tokens:
                sampled[rid] = (sampled_token(rid, num_tokens),)
        return WorkerOutcome(sampled_token_ids=sampled)


class ObserveDriver(BareDriver):
    """Bare stepping plus one observation of the whole state (``target.observe()``,
    the observer the Runner uses) after each of the two scheduler calls: the least
    any checker that reads the scheduler's state after every call must do. No
    claim, no model, no data oracle, no Runner."""

    def step(self) -> None:
        self._top_up()
        step = self.target.schedule()
        self.target.observe()
        self.target.update_from_output(self._sample(step))
        self.target.observe()
        self.live = {rid for rid in self.live if rid in self.requests}


def parse_args(doc: str, default_out: Path, argv: list[str] | None):
    """The options both benchmarks take."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0,
                    help="timed wall clock per configuration and mode (default 5)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--production", type=int, default=PRODUCTION_CONCURRENCY, metavar="N",
                    help="concurrency of the production-sized row (10,000 blocks, "
                         f"2,000-token prompts; default {PRODUCTION_CONCURRENCY}; 0: leave it out)")
    ap.add_argument("--out", type=Path, default=default_out)
    return ap.parse_args(argv)


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


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def compare(target: str, n: int, seconds: float, token_range: tuple[int, int],
            shape: Shape = SMALL) -> dict:
    """Bare, then checked, stepping of one configuration, side by side; the
    checking Runner judging no claim ("no_claims": the observation, the data
    oracle's worker model and the bookkeeping alone), which bounds what faster
    claims could ever give; and bare stepping that only observes the state after
    each call ("observe_only"), which bounds what any checker that reads the
    state could ever reach."""
    bare = measure(lambda: BareDriver(target, n, token_range, shape), seconds)
    checked = measure(lambda: CheckedDriver(target, n, token_range, shape), seconds)
    no_claims = measure(lambda: CheckedDriver(target, n, token_range, shape, kinds=()),
                        seconds)
    observe_only = measure(lambda: ObserveDriver(target, n, token_range, shape), seconds)

    def over_bare(mode: dict) -> float | None:
        return round(mode["steps_per_s"] / bare["steps_per_s"], 5) \
            if bare["steps_per_s"] else None
    ratio = over_bare(checked)
    return {"workload": shape.name, "concurrency": n, "bare": bare, "checked": checked,
            "no_claims": no_claims, "observe_only": observe_only,
            "checked_over_bare": ratio, "no_claims_over_bare": over_bare(no_claims),
            "observe_only_over_bare": over_bare(observe_only),
            "overhead_x": round(1 / ratio, 2) if ratio else None}


def environment(seconds: float) -> dict:
    import datetime as dt
    import platform
    import sys
    return {"python": sys.version.split()[0],
            "implementation": platform.python_implementation(),
            "platform": platform.platform(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "seconds_per_measurement": seconds,
            "warmup_steps": WARMUP_STEPS, **describe_collector()}


WORKLOADS = {shape.name: shape.describe() for shape in (SMALL, PRODUCTION)}


def write_and_print(result: dict, out: Path) -> None:
    import json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{'workload':>10} {'N':>5}  {'bare steps/s':>13}  {'checked steps/s':>16}  "
          f"{'checked/bare':>12}  {'no claims/bare':>14}  {'observe only/bare':>17}")

    def shown(ratio, width: int) -> str:
        return f"{(f'{ratio:.4f}' if ratio is not None else 'n/a'):>{width}}"
    for row in result["results"]:
        print(f"{row.get('workload', 'small'):>10} {row['concurrency']:>5}  "
              f"{row['bare']['steps_per_s']:>13.2f}  "
              f"{row['checked']['steps_per_s']:>16.2f}  "
              f"{shown(row['checked_over_bare'], 12)}  "
              f"{shown(row.get('no_claims_over_bare'), 14)}  "
              f"{shown(row.get('observe_only_over_bare'), 17)}")
    print(f"wrote {out}")
