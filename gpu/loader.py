"""The loader: moves a request's stored blocks from the external store into
the paged cache, synchronously or in the background, and reports what a KV
connector's worker side reports to the scheduler: ``finished_recving``
(requests whose async loads completed), ``invalid_block_ids`` (vLLM's
``get_block_ids_with_load_errors``) and requests whose whole load failed.

A load is batched: the store slots it reads are grouped into runs of
consecutive slots and each run is one copy. On CUDA each run crosses to the
device as one DMA from the pinned slab into a device staging tensor, and one
``index_copy_`` scatters the batch into the destination blocks (a
device-to-device kernel, a few percent of the transfer), all on a dedicated
``torch.cuda.Stream`` that first waits for the compute stream (a block's
previous user is done with it), an event marking the end. On the CPU a run of
consecutive slots into consecutive blocks is one slice copy (a memcpy) straight
from the slab into the cache, in a worker thread for an async load.

Faults are the environment's choice (``LoadFault``): a failed block gets
garbage (seeded, scale ``GARBAGE_SCALE``, far from any real K/V) instead of
its content, as a transfer that died half way would leave it, and is reported.
"""
from __future__ import annotations

import concurrent.futures
import zlib
from typing import Hashable, Sequence

import attrs
import torch

from kvspec.gpu.paged_cache import PagedKVCache
from kvspec.gpu.store import KVStore

#: magnitude of the garbage a failed load writes: real K/V of the tiny model
#: are of order 1, so garbage is off by three orders of magnitude per element
GARBAGE_SCALE = 1e3


@attrs.frozen
class LoadFault:
    """What the environment makes one load do wrong: the destination blocks
    that receive garbage (reported as invalid block ids), or the whole request
    (every block gets garbage; reported as a failed request)."""

    invalid_block_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)
    fail_request: bool = False


@attrs.frozen
class LoadReport:
    """What the loader reports for a step (each item once).

    ``finished_recving``: requests whose async loads completed, failed ones
    included (the request's load is over either way). ``invalid_block_ids``:
    blocks a load failed to fill. ``failed_recving``: requests whose whole
    async load failed; their blocks are not repeated in ``invalid_block_ids``
    (a target without a per-request report adds them itself:
    ``LoadResult.block_ids``). A synchronous load has no request-level report,
    so a whole failed sync load reports all its blocks as invalid."""

    finished_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()
    failed_recving: frozenset[str] = frozenset()


@attrs.frozen
class LoadResult:
    """One load, as done: where it wrote and what it got wrong."""

    request_id: str
    block_ids: tuple[int, ...]
    invalid_block_ids: frozenset[int]
    failed: bool


def compute_runs(slots: Sequence[int],
                 block_ids: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """``(first index, first slot, length)`` of each run of consecutive slots
    (and, if ``block_ids`` are given, consecutive destination blocks too):
    each run is one contiguous copy out of the slab (into the cache)."""
    def extends(index: int) -> bool:
        first, start, length = runs[-1]
        return (slots[index] == start + length and
                (block_ids is None or block_ids[index] == block_ids[first] + length))

    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and extends(index):
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((index, slot, 1))
    return runs


def compute_garbage(block_shape: Sequence[int], dtype: torch.dtype, seed: int,
                    block_id: int) -> torch.Tensor:
    """The garbage a failed load writes into ``block_id``: Gaussian of scale
    ``GARBAGE_SCALE`` from a generator seeded by (seed, block id) with a stable
    hash (``hash(str)`` changes between processes), drawn on the CPU so every
    device gets the same bytes."""
    stable = zlib.crc32(f"{seed}:{block_id}".encode())
    generator = torch.Generator().manual_seed(stable)
    return (torch.randn(*block_shape, generator=generator) * GARBAGE_SCALE).to(dtype)


@attrs.define(eq=False)
class _Job:
    result: LoadResult
    slots: list[int]
    #: the CUDA event or the future that says the copies are done (set at start)
    done: object = None
    staging: torch.Tensor | None = None  # kept alive until the copy completes


class KVLoader:
    """Loads from ``store`` into ``cache`` (see the module docstring). Not
    thread-safe: one scheduler loop drives it."""

    def __init__(self, store: KVStore, cache: PagedKVCache, seed: int = 0) -> None:
        if store.block_shape != cache.block_shape or store.slab.dtype != cache.dtype:
            raise ValueError(f"store blocks {store.block_shape} {store.slab.dtype} do not fit "
                             f"the cache's {cache.block_shape} {cache.dtype}")
        self.store = store
        self.cache = cache
        self.seed = seed
        self.is_cuda = cache.device.type == "cuda"
        self._stream = torch.cuda.Stream(cache.device) if self.is_cuda else None
        self._pool = None if self.is_cuda else concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kv-loader")
        self._in_flight: dict[str, _Job] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._invalid: set[int] = set()

    # -- loads ---------------------------------------------------------------

    def load(self, request_id: str, block_hashes: Sequence[Hashable],
             block_ids: Sequence[int], fault: LoadFault | None = None) -> LoadResult:
        """Load now, on the compute stream, and return when it is done. The
        invalid block ids also go to the next ``get_block_ids_with_load_errors``;
        a whole failed sync load reports all its blocks there (``LoadReport``)."""
        job = self._prepare(request_id, block_hashes, block_ids, fault)
        self._transfer(job)
        if self.is_cuda:
            # the copies read the pinned slab asynchronously: a later save may
            # reuse these slots, so the load is over only when the stream is
            torch.cuda.current_stream(self.cache.device).synchronize()
        self._invalid |= job.result.invalid_block_ids
        if job.result.failed:
            self._invalid |= set(job.result.block_ids)
        return job.result

    def start_load(self, request_id: str, block_hashes: Sequence[Hashable],
                   block_ids: Sequence[int], fault: LoadFault | None = None) -> None:
        """Start loading in the background; the request shows in
        ``get_finished`` once every block is in place."""
        if request_id in self._in_flight:
            raise ValueError(f"request {request_id!r} already has a load in flight")
        job = self._prepare(request_id, block_hashes, block_ids, fault)
        self.store.pin(job.slots)
        if self.is_cuda:
            compute = torch.cuda.current_stream(self.cache.device)
            with torch.cuda.stream(self._stream):
                self._stream.wait_stream(compute)
                self._transfer(job)
                job.done = torch.cuda.Event()
                job.done.record(self._stream)
        else:
            job.done = self._pool.submit(self._transfer, job)
        self._in_flight[request_id] = job

    def _prepare(self, request_id, block_hashes, block_ids, fault) -> _Job:
        if len(block_hashes) != len(block_ids):
            raise ValueError(f"request {request_id!r}: {len(block_hashes)} block hashes for "
                             f"{len(block_ids)} blocks")
        if not block_ids:
            raise ValueError(f"request {request_id!r}: a load needs at least one block")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"request {request_id!r}: block ids {list(block_ids)} repeat a block")
        self.cache.check_block_ids(block_ids)
        fault = fault or LoadFault()
        stray = fault.invalid_block_ids - set(block_ids)
        if stray:
            raise ValueError(f"request {request_id!r}: fault names blocks {sorted(stray)} "
                             "the load does not write")
        slots = self.store.get_slots(block_hashes)
        # a failed request is reported whole, not block by block (LoadReport)
        invalid = frozenset() if fault.fail_request else fault.invalid_block_ids
        result = LoadResult(request_id, tuple(block_ids), invalid, fault.fail_request)
        return _Job(result, slots)

    def _transfer(self, job: _Job) -> None:
        """The copies of one load, batched; then the garbage of its faults."""
        kv, slab = self.cache.kv, self.store.slab
        block_ids = list(job.result.block_ids)
        if self.is_cuda:
            index = self.cache.get_index(block_ids)
            job.staging = torch.empty((len(block_ids), *self.cache.block_shape),
                                      dtype=kv.dtype, device=kv.device)
            for first, start, length in compute_runs(job.slots):
                job.staging[first:first + length].copy_(slab[start:start + length],
                                                        non_blocking=True)
            kv.index_copy_(0, index, job.staging)
        else:
            # host to host, a slice copy is a memcpy; index_copy_ is not
            # (13 against 34 GB/s for 64 blocks of 512 KiB on the 2-core EPYC
            # this was written on), and a Python call per run costs microseconds
            for first, start, length in compute_runs(job.slots, block_ids):
                block = block_ids[first]
                kv[block:block + length].copy_(slab[start:start + length])
        bad = sorted(set(block_ids) if job.result.failed else job.result.invalid_block_ids)
        if bad:
            garbage = torch.stack([compute_garbage(self.cache.block_shape, kv.dtype, self.seed, b)
                                   for b in bad])
            kv.index_copy_(0, self.cache.get_index(bad), garbage.to(kv.device))

    # -- reports -------------------------------------------------------------

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._in_flight

    def get_num_in_flight(self) -> int:
        return len(self._in_flight)

    def poll(self) -> None:
        """Collect the async loads that completed since the last poll into the
        next report. A load that raised re-raises here."""
        for request_id, job in list(self._in_flight.items()):
            if self._is_done(job):
                self._collect(request_id, job)

    def wait(self) -> None:
        """Block until every async load in flight completed, and collect them."""
        for request_id, job in list(self._in_flight.items()):
            if self.is_cuda:
                job.done.synchronize()
            else:
                job.done.result()
            self._collect(request_id, job)

    def _is_done(self, job: _Job) -> bool:
        return job.done.query() if self.is_cuda else job.done.done()

    def _collect(self, request_id: str, job: _Job) -> None:
        del self._in_flight[request_id]
        self.store.unpin(job.slots)
        if not self.is_cuda:
            job.done.result()  # re-raise what the worker thread raised
        self._finished.add(request_id)
        self._invalid |= job.result.invalid_block_ids
        if job.result.failed:
            self._failed.add(request_id)

    def get_finished(self) -> set[str]:
        """Poll, then hand over the requests whose async loads completed
        (vLLM's ``finished_recving``), each once."""
        self.poll()
        finished, self._finished = self._finished, set()
        return finished

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that loads collected so far failed to fill, each once."""
        invalid, self._invalid = self._invalid, set()
        return invalid

    def get_failed_recving(self) -> set[str]:
        """Requests whose whole async load failed, collected so far, each once."""
        failed, self._failed = self._failed, set()
        return failed

    def report(self) -> LoadReport:
        """Poll and hand over everything at once: what a worker returns for a step."""
        return LoadReport(frozenset(self.get_finished()),
                          frozenset(self.get_block_ids_with_load_errors()),
                          frozenset(self.get_failed_recving()))

    def close(self) -> None:
        """Wait for the loads in flight and stop the worker thread."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
