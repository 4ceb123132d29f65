"""KV loader bandwidth against a plain copy of the same bytes, and the per-step
cost of the block checksum check (issue 13, ``kvspec.gpu``).

Block shape: block size 16, 8 KV heads, head dim 128, float16, K and V for
``--layers`` layers (32 by default: 2 MiB a block). For each batch of N blocks
(1, 4, 16, 64, 256 by default), side by side in one process, interleaved
repetition by repetition, median taken:

- **plain**: one ``copy_`` of N blocks' bytes from a contiguous host tensor
  (pinned when CUDA is available) to a contiguous device tensor; on CUDA the
  copy is a pinned host-to-device DMA;
- **loader sync** / **loader async**: ``KVLoader.load`` and
  ``KVLoader.start_load`` + ``wait`` of N stored blocks into N cache blocks,
  the store slots and the destination blocks in random order (a fragmented
  store and pool: the worst case for batching, one copy per block), and
  **loader contiguous**: slots and destinations in order (one copy per batch);
- **checksum**: ``check_blocks`` of the N loaded blocks against expected sums:
  the device pass, the one copy of the sums to the host and the comparison.

Bandwidth is block bytes / time; "fraction" is loader / plain. On a machine
without CUDA everything is host memory (host-to-host copies, no pinning):
the JSON says ``"device_kind": "cpu"`` and ``"gpu_figure": "unmeasured"``, and
those figures say nothing about the issue's GPU goal (80% of a pinned
host-to-device copy at 64 blocks or more).

    python bench/bench_kv_loader.py                 # CUDA if present, else CPU
    python bench/bench_kv_loader.py --quick         # 8 layers, 2 repetitions, N up to 64
    python bench/bench_kv_loader.py --layers 16 --reps 5 --out /tmp/kv.json

Writes ``bench/kv_loader_results.json`` (device name, torch version, date,
git commit, every figure) and prints a table.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from kvspec.gpu.checksum import ExpectedBlock, check_blocks, compute_block_checksums
from kvspec.gpu.loader import KVLoader
from kvspec.gpu.paged_cache import PagedKVCache, get_device
from kvspec.gpu.store import KVStore

from drivers import git_commit  # bench/ is the script's directory: the benches share it

DEFAULT_OUT = Path(__file__).resolve().parent / "kv_loader_results.json"
BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, DTYPE = 16, 8, 128, torch.float16


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="layers per block (default 32)")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="blocks per load (default 1 4 16 64 256)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions per figure (default 20 on CUDA, 5 on CPU)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    ap.add_argument("--quick", action="store_true",
                    help="8 layers, 2 repetitions, batches up to 64")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    device = get_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quick = args.quick
    args.device = device
    args.layers = args.layers or (8 if quick else 32)
    args.batches = args.batches or ([1, 4, 16, 64] if quick else [1, 4, 16, 64, 256])
    args.reps = args.reps or (2 if quick else 20 if device.type == "cuda" else 5)
    return args


def get_device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, run) -> float:
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


class Bench:
    """The cache, the store and the plain-copy buffers, sized for the largest batch."""

    def __init__(self, device: torch.device, layers: int, max_batch: int) -> None:
        self.device = device
        # a scattered load picks N of the first 2N blocks and slots; a
        # contiguous one writes blocks 2 * max_batch on, so the two never overlap
        self.max_batch = max_batch
        self.cache = PagedKVCache.allocate(3 * max_batch, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                                           [list(range(layers))], dtype=DTYPE, device=device)
        generator = torch.Generator().manual_seed(0)
        for b in range(self.cache.num_blocks):  # random content, one block at a time (memory)
            self.cache.kv[b].copy_(torch.randn(self.cache.block_shape, generator=generator))
        self.store = KVStore.for_cache(self.cache, capacity=2 * max_batch)
        # block order[i] lands in slot i (slots are handed out in order): the
        # hash ("h", b) of a scattered load sits at a random slot
        self.order = torch.randperm(2 * max_batch, generator=generator).tolist()
        self.store.save_blocks([("h", b) for b in self.order], self.cache, self.order)
        self.loader = KVLoader(self.store, self.cache)
        self.host = self.store.slab[:max_batch]  # contiguous, pinned where CUDA is
        self.target = torch.empty_like(self.host, device=device)
        self.generator = generator

    def get_load(self, n: int, contiguous: bool) -> tuple[list, list[int]]:
        """Hashes and destination blocks of an N-block load."""
        if contiguous:
            first = 2 * self.max_batch
            return [("h", b) for b in self.order[:n]], list(range(first, first + n))
        picks = torch.randperm(2 * n, generator=self.generator)[:n].tolist()
        dst = torch.randperm(2 * n, generator=self.generator)[:n].tolist()
        return [("h", b) for b in picks], dst

    def measure(self, n: int, reps: int, layers: int) -> dict:
        nbytes = n * self.cache.get_block_nbytes()
        hashes, dst = self.get_load(n, contiguous=False)
        chashes, cdst = self.get_load(n, contiguous=True)
        calls = {
            "plain": lambda: self.target[:n].copy_(self.host[:n], non_blocking=True),
            "loader_sync": lambda: self.loader.load("r", hashes, dst),
            "loader_async": lambda: (self.loader.start_load("r", hashes, dst), self.loader.wait()),
            "loader_contiguous": lambda: self.loader.load("r", chashes, cdst),
        }
        self.loader.load("r", hashes, dst)
        expected = self.get_expected(dst)
        calls["checksum"] = lambda: check_blocks(self.cache, expected, step=0)
        times = {name: [] for name in calls}
        for name, call in calls.items():  # warm-up: allocator, threads, caches
            timed(self.device, call)
        for _ in range(reps):
            for name, call in calls.items():
                times[name].append(timed(self.device, call))
        self.loader.report()
        assert not check_blocks(self.cache, expected, step=0), "a load left wrong KV"
        median = {name: statistics.median(ts) for name, ts in times.items()}
        gbps = {name: nbytes / median[name] / 1e9 for name in median}
        return {
            "blocks": n, "bytes": nbytes,
            "seconds": {name: round(t, 6) for name, t in median.items()},
            "gb_per_s": {name: round(g, 3) for name, g in gbps.items() if name != "checksum"},
            "fraction_of_plain": {name: round(gbps[name] / gbps["plain"], 3)
                                  for name in ("loader_sync", "loader_async", "loader_contiguous")},
            "checksum_ms": round(median["checksum"] * 1e3, 3),
            "checksum_over_load": round(median["checksum"] / median["loader_sync"], 3),
        }

    def get_expected(self, block_ids: list[int]) -> list[ExpectedBlock]:
        """What the blocks hold once loaded: their current sums (the bench times
        the check, not the reference forward that predicts them on the host)."""
        sums = compute_block_checksums(self.cache, block_ids).cpu()
        return [ExpectedBlock("r", b, i, 0, self.cache.block_size, s, s.abs() + 1.0)
                for i, (b, s) in enumerate(zip(block_ids, sums))]


def run(args) -> dict:
    device = args.device
    is_cuda = device.type == "cuda"
    started = time.perf_counter()
    bench = Bench(device, args.layers, max(args.batches))
    rows = []
    for n in args.batches:
        rows.append(bench.measure(n, args.reps, args.layers))
        print_row(rows[-1])
    bench.loader.close()
    block_bytes = bench.cache.get_block_nbytes()
    return {
        "note": (("CUDA figures: plain is a pinned host-to-device copy of the same bytes"
                  if is_cuda else
                  "CPU figures: no CUDA device, so every copy is host to host (no pinned "
                  "memory); they do not measure the GPU goal, which stays unmeasured")
                 + "; loader and plain measured side by side, interleaved, median of reps"),
        "device_kind": device.type,
        "device": get_device_name(device),
        "gpu_figure": "measured" if is_cuda else "unmeasured",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "block": {"block_size": BLOCK_SIZE, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": str(DTYPE).removeprefix("torch."), "layers": args.layers,
                  "bytes": block_bytes},
        "store_pinned": bench.store.is_pinned,
        "reps": args.reps,
        "results": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def print_row(row: dict) -> None:
    f = row["fraction_of_plain"]
    print(f"{row['blocks']:>5} blocks  plain {row['gb_per_s']['plain']:7.2f} GB/s  "
          f"loader sync {row['gb_per_s']['loader_sync']:7.2f} GB/s ({f['loader_sync']:.2f})  "
          f"async {f['loader_async']:.2f}  contiguous {f['loader_contiguous']:.2f}  "
          f"checksum {row['checksum_ms']:.2f} ms ({row['checksum_over_load']:.2f} of a load)",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{result['note']}\nwrote {args.out} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
