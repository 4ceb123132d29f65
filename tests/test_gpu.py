"""Real KV tensors (issue 13, ``kvspec.gpu``): the paged cache, the tiny
transformer's paged forward against its no-cache reference, the store and
the batched sync/async loader with injected faults, and the block checksums
that name a block holding the wrong KV.

Every device test runs on the CPU and on CUDA where a device is present.
Expected tokens, logits and KV come from the no-cache reference forward or
from content the test wrote itself, never from the path under test.
"""
from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="kvspec.gpu needs torch (pip install -e '.[gpu]')")

from kvspec.gpu.checksum import (BlockMismatch, check_blocks,  # noqa: E402
                                 compute_block_checksums, compute_block_fingerprints,
                                 compute_expected_checksums, compute_fingerprints,
                                 get_expected_blocks)
from kvspec.gpu.loader import (GARBAGE_SCALE, KVLoader, LoadFault, LoadReport,  # noqa: E402
                               compute_garbage, compute_runs)
from kvspec.gpu.model import TinyConfig, TinyTransformer  # noqa: E402
from kvspec.gpu.paged_cache import PagedKVCache, get_device  # noqa: E402
from kvspec.gpu.store import KVStore  # noqa: E402
from kvspec.spec.groups import NULL_BLOCK, get_group_cache_key  # noqa: E402

DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="no CUDA device"))]

#: Logits of the paged forward against the reference. Both run float32 with
#: the same ops; only the shapes of the matmuls and of the softmax differ
#: (chunk rows against all rows, a gathered window against a masked full
#: row), which reorders reductions of at most 4 * hidden = 256 terms per
#: layer: a few ulp per op, 1.6e-6 measured on logits of magnitude <= 4. 1e-4
#: leaves ~60x margin; a block of wrong KV moves logits by 1e-1 or more
#: (test_corrupt_block_moves_logits_far_beyond_tolerance).
LOGITS_TOL = 1e-4
BLOCK_SIZE = 4


def prompt(seed: int, length: int, vocab: int = 101) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def make_tables(cache: PagedKVCache, num_tokens: int, first_block: int) -> list[list[int]]:
    """Fresh blocks for ``num_tokens`` positions in every group, from ``first_block`` on."""
    per_group = -(-num_tokens // cache.block_size)
    return [list(range(first_block + g * per_group, first_block + (g + 1) * per_group))
            for g in range(cache.num_groups)]


def run_paged(model, cache, tokens, tables, chunk: int | None, start: int = 0) -> torch.Tensor:
    """Logits of positions ``start..`` computed ``chunk`` tokens per step."""
    chunk = chunk or len(tokens)
    logits = [model.forward_paged(cache, tokens[n:n + chunk], tables, n)
              for n in range(start, len(tokens), chunk)]
    return torch.cat(logits)


def decode_reference(model, tokens: list[int], num_new: int) -> list[int]:
    tokens = list(tokens)
    for _ in range(num_new):
        tokens.append(int(model.forward_reference(tokens)[-1].argmax()))
    return tokens[-num_new:]


def decode_paged(model, cache, tokens: list[int], tables, num_computed: int,
                 num_new: int, chunk: int | None = None) -> list[int]:
    """Prefill from ``num_computed`` (the rest came from the cache), then
    greedy decode one token per step through the paged cache."""
    tokens = list(tokens)
    logits = run_paged(model, cache, tokens, tables, chunk, start=num_computed)
    for _ in range(num_new):
        tokens.append(int(logits[-1].argmax()))
        logits = model.forward_paged(cache, tokens[-1:], tables, len(tokens) - 1)
    return tokens[-num_new:]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (actual.cpu() - expected.cpu()).abs().max().item()
    assert diff <= LOGITS_TOL, f"logits differ by {diff:.3g} > {LOGITS_TOL}"


@pytest.fixture(scope="module")
def models():
    """One model per (device, window): building the weights is the slow part."""
    built = {}

    def get(device: str, window: int = 0) -> TinyTransformer:
        if (device, window) not in built:
            built[device, window] = TinyTransformer(TinyConfig(sliding_window=window), device)
        return built[device, window]
    return get


# -- the tiny transformer through the paged cache -----------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 3], ids=["full", "sliding3"])
@pytest.mark.parametrize("chunk", [1, 3, None], ids=["chunk1", "chunk3", "whole"])
def test_chunked_prefill_matches_reference(models, device, window, chunk):
    model = models(device, window)
    tokens = prompt(1, 14)
    cache = model.allocate_cache(num_blocks=12, block_size=BLOCK_SIZE)
    tables = make_tables(cache, len(tokens), first_block=1)
    logits = run_paged(model, cache, tokens, tables, chunk)
    reference = model.forward_reference(tokens)
    assert_close(logits, reference)
    assert logits.argmax(-1).tolist() == reference.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 3], ids=["full", "sliding3"])
def test_greedy_decode_matches_reference(models, device, window):
    model = models(device, window)
    tokens = prompt(2, 9)
    cache = model.allocate_cache(num_blocks=16, block_size=BLOCK_SIZE)
    tables = make_tables(cache, len(tokens) + 6, first_block=0)
    assert decode_paged(model, cache, tokens, tables, 0, 6, chunk=4) == \
        decode_reference(model, tokens, 6)


def test_sliding_window_changes_the_model(models):
    """The window is real: the same weights without it give other logits (a
    mask that never applied would pass the equality tests on both paths)."""
    tokens = prompt(3, 12)
    full = models("cpu", 0).forward_reference(tokens)
    windowed = models("cpu", 3).forward_reference(tokens)
    assert torch.equal(full[:3], windowed[:3])  # inside the first window: same reads
    assert (full[3:] - windowed[3:]).abs().max() > 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_sliding_group_reads_only_its_window(models, device):
    """Behind the window a sliding group's blocks may hold garbage or be given
    back (null): the next step does not read them. Inside it, it does."""
    model = models(device, 3)
    tokens = prompt(4, 15)
    cache = model.allocate_cache(num_blocks=12, block_size=BLOCK_SIZE)
    tables = make_tables(cache, len(tokens), first_block=0)
    run_paged(model, cache, tokens[:14], tables, None)
    reference = model.forward_reference(tokens)[-1:]
    # the step at 14 reads [12, 14] in the window layers: blocks 0..2 are behind it
    sliding = tables[1]
    garbage = compute_garbage(cache.block_shape, cache.dtype, 0, sliding[2])[None]
    cache.write_blocks([sliding[2]], garbage)  # positions 8..11
    assert_close(model.forward_paged(cache, tokens[14:], tables, 14), reference)
    freed = [tables[0], [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, sliding[3]]]
    assert_close(model.forward_paged(cache, tokens[14:], freed, 14), reference)
    cache.write_blocks([sliding[3]], garbage)  # positions 12..15: inside the window
    moved = (model.forward_paged(cache, tokens[14:], freed, 14).cpu() - reference.cpu()).abs()
    assert moved.max() > 1e-1


def test_corrupt_block_moves_logits_far_beyond_tolerance(models):
    model = models("cpu")
    tokens = prompt(5, 12)
    cache = model.allocate_cache(num_blocks=4, block_size=BLOCK_SIZE)
    tables = make_tables(cache, len(tokens), first_block=0)
    run_paged(model, cache, tokens[:8], tables, None)
    cache.copy_blocks([0], [1])  # block 1 (positions 4..7) now holds positions 0..3's KV
    logits = run_paged(model, cache, tokens, tables, None, start=8)
    assert (logits - model.forward_reference(tokens)[8:]).abs().max() > 1000 * LOGITS_TOL


# -- the paged cache -----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_write_and_gather_through_block_table(device):
    cache = PagedKVCache.allocate(6, 2, 1, 3, [[0, 1]], device=device)
    key = torch.arange(15, dtype=torch.float32).view(5, 1, 3)
    value = -key
    table = [4, 1, 3]  # positions 0,1 -> block 4; 2,3 -> block 1; 4 -> block 3 slot 0
    cache.write(1, table, range(5), key, value)
    k, v = cache.gather(1, table, [3, 0, 4])
    assert torch.equal(k.cpu(), key[[3, 0, 4]]) and torch.equal(v.cpu(), value[[3, 0, 4]])
    assert torch.equal(cache.get_key_cache(1)[1, 1].cpu(), key[3])  # block 1, slot 1
    assert cache.get_key_cache(0).abs().sum() == 0  # layer 0 untouched
    assert cache.get_value_cache(1)[[0, 2, 5]].abs().sum() == 0  # other blocks untouched


@pytest.mark.parametrize("device", DEVICES)
def test_groups_share_one_pool_by_layer_slot(device):
    """Layer j of every group is slot j of the block its table names (vLLM's
    hybrid layout): group 1's layer 3 writes slot 1 of group 1's block."""
    cache = PagedKVCache.allocate(4, 2, 1, 2, [[0, 2], [1, 3]], device=device)
    assert cache.get_placement(3) == (1, 1) and cache.get_placement(2) == (0, 1)
    ones = torch.ones(2, 1, 2)
    cache.write(3, [2], range(2), ones, 2 * ones)
    assert torch.equal(cache.kv[2, 1, 1].cpu(), 2 * ones) and cache.kv[2, 0].abs().sum() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_reads_sources_before_writing(device):
    cache = PagedKVCache.allocate(4, 2, 1, 2, [[0]], device=device)
    for b in range(4):
        cache.kv[b] = b
    cache.copy_blocks([0, 1], [1, 2])  # a chain: block 2 must get block 1's old content
    assert [int(cache.kv[b].flatten()[0]) for b in range(4)] == [0, 0, 1, 3]


@pytest.mark.parametrize("call, message", [
    (lambda c: c.gather(0, [0, 9], range(4)), "block id 9 is outside the pool of 4"),
    (lambda c: c.gather(0, [0], range(3)), "position 2 is outside a block table of 1"),
    (lambda c: c.gather(0, [NULL_BLOCK, 1], range(3)), "position 0 lies in block 0, which"),
    (lambda c: c.write(0, [0], range(2), torch.ones(2, 1, 2), torch.ones(2, 1, 3)),
     "value of shape (2, 1, 3), expected (2, 1, 2)"),
    (lambda c: c.get_key_cache(5), "layer 5 is not in the cache"),
    (lambda c: c.write_blocks([1, 1], torch.zeros(2, *c.block_shape)), "repeat a block"),
    (lambda c: c.copy_blocks([0], [1, 2]), "1 source blocks but 2 destinations"),
    (lambda c: PagedKVCache.allocate(0, 2, 1, 2, [[0]]), "num_blocks=0"),
    (lambda c: PagedKVCache.allocate(2, 2, 1, 2, [[0], [2]]), "must be 0..n-1"),
    (lambda c: get_device("tpu"), "only cpu and cuda"),
    (lambda c: get_device("gpu:0"), "unknown device 'gpu:0': only cpu and cuda"),
    (lambda c: TinyConfig(num_heads=3), "not a multiple of num_kv_heads=2"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_a_one_line_value_error(call, message):
    cache = PagedKVCache.allocate(4, 2, 1, 2, [[0]])
    with pytest.raises(ValueError) as error:
        call(cache)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_device_is_a_value_error():
    with pytest.raises(ValueError, match="no CUDA device on this machine"):
        get_device("cuda")


def test_paged_forward_rejects_bad_steps(models):
    model = models("cpu")
    cache = model.allocate_cache(4, BLOCK_SIZE)
    for call, message in [
        (lambda: model.forward_paged(cache, [1, 2], [[0]], 0, positions=[1, 2]), "are not 0..1"),
        (lambda: model.forward_paged(cache, [1, 500], [[0]], 0), "token 500 is outside"),
        (lambda: model.forward_paged(cache, [1], [[0], [1]], 0), "2 block tables for 1 groups"),
        (lambda: model.forward_paged(PagedKVCache.allocate(4, 4, 1, 16, [[0, 1, 2, 3]]), [1],
                                     [[0]], 0), "does not fit the model's"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()


# -- store and loader ----------------------------------------------------------


def random_cache(device, num_blocks=12, dtype=torch.float16) -> PagedKVCache:
    cache = PagedKVCache.allocate(num_blocks, 4, 2, 8, [[0, 1, 2]], dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(7)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=generator).to(dtype))
    return cache


def test_compute_runs_groups_consecutive_slots():
    assert compute_runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert compute_runs([3, 3]) == [(0, 3, 1), (1, 3, 1)]
    assert compute_runs([]) == []
    assert compute_runs([4, 5, 6, 7], [9, 10, 2, 3]) == [(0, 4, 2), (2, 6, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_load_round_trip_is_bit_exact(device, mode):
    source = random_cache(device)
    store = KVStore.for_cache(source, capacity=8)
    store.save_blocks(["a", "b"], source, [3, 5])
    store.save("x", source, 0)  # an unrelated block between: the slots are not one run
    store.save("c", source, 7)
    assert store.is_pinned == torch.cuda.is_available()
    target = PagedKVCache.allocate(12, 4, 2, 8, [[0, 1, 2]], dtype=torch.float16, device=device)
    loader = KVLoader(store, target)
    if mode == "sync":
        result = loader.load("r", ["a", "b", "c"], [10, 2, 8])
        assert not result.invalid_block_ids and not result.failed
    else:
        loader.start_load("r", ["a", "b", "c"], [10, 2, 8])
        loader.wait()
    for src, dst in [(3, 10), (5, 2), (7, 8)]:
        assert torch.equal(target.kv[dst], source.kv[src]), f"block {src} -> {dst}"
    untouched = [b for b in range(12) if b not in (10, 2, 8)]
    assert target.kv[untouched].abs().sum() == 0, "the load wrote outside its blocks"
    fingerprints = compute_fingerprints(torch.stack([store.get_block(h) for h in "abc"]))
    assert compute_block_fingerprints(target, [10, 2, 8]).cpu().tolist() == fingerprints.tolist()
    assert loader.report() == LoadReport(frozenset({"r"}) if mode == "async" else frozenset())
    loader.close()


def wait_for_report(loader: KVLoader, timeout: float = 10.0) -> LoadReport:
    deadline = time.monotonic() + timeout
    while loader.get_num_in_flight():
        assert time.monotonic() < deadline, "async load never completed"
        time.sleep(0.001)
        loader.poll()
    return loader.report()


@pytest.mark.parametrize("device", DEVICES)
def test_async_load_completes_and_is_reported_once(device):
    source = random_cache(device)
    store = KVStore.for_cache(source, capacity=8)
    store.save_blocks(["a", "b", "c", "d"], source, [0, 1, 2, 3])
    target = PagedKVCache.allocate(12, 4, 2, 8, [[0, 1, 2]], dtype=torch.float16, device=device)
    loader = KVLoader(store, target)
    loader.start_load("r1", ["a", "b"], [4, 5])
    loader.start_load("r2", ["c", "d"], [6, 7])
    assert loader.is_loading("r1")
    seen = set()
    deadline = time.monotonic() + 10
    while seen != {"r1", "r2"}:
        assert time.monotonic() < deadline, "async loads never completed"
        finished = loader.get_finished()
        assert not finished & seen, f"{finished & seen} reported twice"
        for request_id in finished:  # reported only once its blocks are in place
            pairs = {"r1": [(0, 4), (1, 5)], "r2": [(2, 6), (3, 7)]}[request_id]
            assert all(torch.equal(target.kv[d], source.kv[s]) for s, d in pairs)
        seen |= finished
        time.sleep(0.001)
    assert not loader.is_loading("r1") and loader.report() == LoadReport()
    loader.close()


def test_async_load_is_not_reported_before_its_copies_ran(monkeypatch):
    """CPU: the worker thread's copy is held at a gate; until it opens, the
    request is in flight and not finished, whatever polls happen."""
    source = random_cache("cpu")
    store = KVStore.for_cache(source, capacity=4)
    store.save_blocks(["a"], source, [0])
    loader = KVLoader(store, source)
    gate, transfer = threading.Event(), loader._transfer

    def held(job):
        assert gate.wait(10), "gate never opened"
        transfer(job)

    monkeypatch.setattr(loader, "_transfer", held)
    loader.start_load("r", ["a"], [5])
    time.sleep(0.01)
    assert loader.get_finished() == set() and loader.is_loading("r")
    gate.set()
    assert wait_for_report(loader).finished_recving == {"r"}
    assert torch.equal(source.kv[5], source.kv[0])
    loader.close()


@pytest.mark.parametrize("device", DEVICES)
def test_store_keeps_pinned_blocks_and_evicts_least_recently_used(device):
    cache = random_cache(device)
    store = KVStore.for_cache(cache, capacity=2)
    store.save_blocks(["a", "b"], cache, [0, 1])
    store.get_slots(["a"])  # "a" used: "b" is now the least recently used
    store.save("c", cache, 2)
    assert store.is_stored("a") and not store.is_stored("b") and store.is_stored("c")
    assert torch.equal(store.get_block("c"), cache.kv[2].cpu())
    assert store.get_num_stored_prefix(["a", "c", "b", "c"]) == 2
    store.pin(store.get_slots(["a", "c"]))
    with pytest.raises(ValueError, match="the store is full"):
        store.save("d", cache, 3)
    store.unpin(store.get_slots(["c"]))
    store.save("d", cache, 3)
    assert store.is_stored("a") and not store.is_stored("c")


def test_loader_rejects_bad_loads():
    cache = random_cache("cpu")
    store = KVStore.for_cache(cache, capacity=4)
    store.save_blocks(["a", "b"], cache, [0, 1])
    loader = KVLoader(store, cache)
    for call, message in [
        (lambda: loader.load("r", ["a"], [2, 3]), "1 block hashes for 2 blocks"),
        (lambda: loader.load("r", ["a", "z"], [2, 3]), "block hash 'z' is not in the store"),
        (lambda: loader.load("r", ["a", "b"], [2, 2]), "repeat a block"),
        (lambda: loader.load("r", ["a"], [12]), "block id 12 is outside the pool of 12"),
        (lambda: loader.load("r", ["a"], [2], LoadFault({5})), "names blocks [5] the load"),
        (lambda: KVLoader(store, PagedKVCache.allocate(4, 4, 2, 8, [[0, 1, 2]])),
         "do not fit the cache's"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            call()
    loader.start_load("r", ["a"], [2])
    with pytest.raises(ValueError, match="already has a load in flight"):
        loader.start_load("r", ["b"], [3])
    loader.close()


# -- checksums against the reference -------------------------------------------


def prefill(model, tokens, num_blocks=16, chunk=3):
    """A cache holding ``tokens``' KV computed chunk by chunk, and its tables."""
    cache = model.allocate_cache(num_blocks, BLOCK_SIZE)
    tables = make_tables(cache, len(tokens), first_block=0)
    run_paged(model, cache, tokens, tables, chunk)
    return cache, tables


def expected_blocks(model, cache, request_id, tokens, tables, num_tokens=None):
    reference = model.compute_reference_kv(tokens)
    num_tokens = len(tokens) if num_tokens is None else num_tokens
    return [e for g, table in enumerate(tables)
            for e in get_expected_blocks(reference, cache, request_id, g, table, num_tokens)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 3], ids=["full", "sliding3"])
def test_checksums_of_a_chunked_prefill_match_the_reference(models, device, window):
    model = models(device, window)
    tokens = prompt(6, 14)  # the last block holds 2 of its 4 positions
    cache, tables = prefill(model, tokens)
    cache.kv[tables[0][-1], :, :, 2:] = 7.0  # stale slots past the request's end: not checked
    expected = expected_blocks(model, cache, "r", tokens, tables)
    assert len(expected) == 4 * cache.num_groups
    assert check_blocks(cache, expected, step=1) == []
    # the margin, not just a pass: the worst block is far inside its tolerance
    sums = compute_block_checksums(cache, [e.block_id for e in expected],
                                   [e.num_valid for e in expected]).cpu()
    worst = max(float(((s[:len(cache.group_layers[e.group])] - e.sums).abs() / e.scales).max())
                for s, e in zip(sums, expected))
    assert worst < 1e-5, f"checksums agree only to {worst:.3g} of the scale"


def test_checksum_names_the_block_and_layer_of_planted_faults(models):
    model = models("cpu")
    tokens = prompt(7, 16)
    cache, tables = prefill(model, tokens)
    expected = expected_blocks(model, cache, "r7", tokens, tables)
    table = tables[0]
    cache.kv[table[1], 2, 1, [0, 1]] = cache.kv[table[1], 2, 1, [1, 0]].clone()  # swap 2 positions
    cache.kv[table[2], 0] = cache.kv[table[3], 0]  # layer 0 of another block (stale layer)
    mismatches = check_blocks(cache, expected, step=5)
    assert [(m.block_id, m.block_index, m.layers) for m in mismatches] == \
        [(table[1], 1, (2,)), (table[2], 2, (0,))]
    assert str(mismatches[0]).startswith(f"step 5: block {table[1]} (index 1, group 0) of "
                                         "request r7 holds the wrong KV in layers [2]")


def test_expected_checksums_reject_positions_past_the_reference(models):
    kv = models("cpu").compute_reference_kv(prompt(8, 5))
    with pytest.raises(ValueError, match="holds positions up to 7, the reference covers 5"):
        compute_expected_checksums(kv, [0], BLOCK_SIZE, 1, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_checksums_agree_across_devices(device):
    """The device computes the same float64 sums the host does (the expected
    side is always computed on the host)."""
    cache = random_cache(device, dtype=torch.float32)
    on_device = compute_block_checksums(cache, [1, 4, 9], [4, 2, 1]).cpu()
    host = PagedKVCache(cache.kv.cpu(), cache.group_layers)
    assert torch.allclose(on_device, compute_block_checksums(host, [1, 4, 9], [4, 2, 1]),
                          rtol=1e-12, atol=0)


def test_fingerprint_sees_a_single_bit():
    blocks = torch.randn(3, 2, 4, 8, generator=torch.Generator().manual_seed(1)).half()
    flipped = blocks.clone()
    flipped.view(torch.int16)[1, 0, 2, 5] ^= 1
    before, after = compute_fingerprints(blocks), compute_fingerprints(flipped)
    assert before[0] == after[0] and before[2] == after[2] and before[1] != after[1]
    swapped = blocks.clone()
    swapped[0, 0, [0, 1]] = blocks[0, 0, [1, 0]]
    assert compute_fingerprints(swapped)[0] != before[0]


# -- faults --------------------------------------------------------------------


def saved_prefix(model, device, tokens, num_blocks):
    """Request A computed ``tokens`` (chunked) and saved its first
    ``num_blocks`` blocks of every group to a store, keyed by prefix hash."""
    cache, tables = prefill(model, tokens, num_blocks=48)
    store = KVStore.for_cache(cache, capacity=16)
    hashes = [tuple(tokens[:(i + 1) * BLOCK_SIZE]) for i in range(num_blocks)]
    for g, table in enumerate(tables):
        store.save_blocks([get_group_cache_key(h, g) for h in hashes], cache, table[:num_blocks])
    return cache, store, hashes


def load_prefix(loader, request_id, hashes, tables, mode, fault=None) -> LoadReport:
    keys = [get_group_cache_key(h, g) for g in range(len(tables)) for h in hashes]
    block_ids = [b for table in tables for b in table[:len(hashes)]]
    if mode == "sync":
        loader.load(request_id, keys, block_ids, fault)
        return loader.report()
    loader.start_load(request_id, keys, block_ids, fault)
    return wait_for_report(loader)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_block_gets_garbage_that_the_checksum_names(models, device, mode):
    model = models(device)
    tokens = prompt(9, 16)
    cache, store, hashes = saved_prefix(model, device, tokens, num_blocks=3)
    loader = KVLoader(store, cache, seed=3)
    tables = [[20, 21, 22, 23]]  # request B's fresh blocks
    report = load_prefix(loader, "B", hashes, tables, mode, LoadFault({21}))
    assert report.invalid_block_ids == {21} and not report.failed_recving
    assert report.finished_recving == ({"B"} if mode == "async" else set())
    garbage = compute_garbage(cache.block_shape, cache.dtype, 3, 21)
    assert torch.equal(cache.kv[21].cpu(), garbage) and garbage.abs().mean() > GARBAGE_SCALE / 2
    expected = expected_blocks(model, cache, "B", tokens, tables, num_tokens=12)
    mismatches = check_blocks(cache, expected, step=2)
    assert [(m.request_id, m.block_id, m.layers) for m in mismatches] == [("B", 21, (0, 1, 2, 3))]
    loader.close()


@pytest.mark.parametrize("device", DEVICES)
def test_failed_request_is_reported_whole(models, device):
    model = models(device)
    tokens = prompt(10, 12)
    cache, store, hashes = saved_prefix(model, device, tokens, num_blocks=2)
    loader = KVLoader(store, cache)
    report = load_prefix(loader, "B", hashes, [[20, 21]], "async", LoadFault(fail_request=True))
    assert report == LoadReport(frozenset({"B"}), frozenset(), frozenset({"B"}))
    expected = expected_blocks(model, cache, "B", tokens, [[20, 21]], num_tokens=8)
    assert [m.block_id for m in check_blocks(cache, expected, step=1)] == [20, 21]
    result = loader.load("C", [get_group_cache_key(h, 0) for h in hashes], [22, 23],
                         LoadFault(fail_request=True))
    assert result.failed and loader.report().invalid_block_ids == {22, 23}  # sync: by block
    loader.close()


# -- prefix reuse --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 3], ids=["full", "sliding3"])
def test_prefix_reuse_through_a_loaded_prefix_gives_reference_tokens(models, device, window):
    """B shares A's first 3 blocks: they come from the store (computed by A in
    chunks of 3), B computes the rest and decodes greedily; B's tokens are the
    reference's, its logits within tolerance, and every block checks clean."""
    model = models(device, window)
    shared = prompt(11, 12)
    a_tokens, b_tokens = shared + prompt(12, 5), shared + prompt(13, 3)
    cache, store, hashes = saved_prefix(model, device, a_tokens, num_blocks=3)
    loader = KVLoader(store, cache)
    per_group = 5  # 15 prompt tokens + 5 new ones
    tables = [list(range(30 + g * per_group, 30 + (g + 1) * per_group))
              for g in range(cache.num_groups)]
    cache.kv[30:] = 5.0  # B's blocks held something else before
    assert load_prefix(loader, "B", hashes, tables, "async").finished_recving == {"B"}
    logits = run_paged(model, cache, b_tokens, tables, None, start=12)
    assert_close(logits, model.forward_reference(b_tokens)[12:])
    assert decode_paged(model, cache, b_tokens, tables, 12, 5) == \
        decode_reference(model, b_tokens, 5)
    assert check_blocks(cache, expected_blocks(model, cache, "B", b_tokens, tables), step=9) == []
    loader.close()


def test_prefix_reuse_with_a_failed_block_is_caught(models):
    """The same reuse with one loaded block failed: the logits move and the
    checksum names the failed block and the one B computed from it."""
    model = models("cpu")
    shared = prompt(11, 12)
    b_tokens = shared + prompt(13, 3)
    cache, store, hashes = saved_prefix(model, "cpu", shared + prompt(12, 5), num_blocks=3)
    loader = KVLoader(store, cache)
    tables = [[30, 31, 32, 33]]
    load_prefix(loader, "B", hashes, tables, "sync", LoadFault({32}))
    logits = run_paged(model, cache, b_tokens, tables, None, start=12)
    assert (logits - model.forward_reference(b_tokens)[12:]).abs().max() > 1000 * LOGITS_TOL
    mismatches = check_blocks(cache, expected_blocks(model, cache, "B", b_tokens, tables), step=1)
    # block 33 too: B computed positions 12..14 there reading the garbage in
    # every layer after the first (why spec.groups taints blocks past a failed one)
    assert [(m.block_id, m.layers) for m in mismatches] == [(32, (0, 1, 2, 3)), (33, (1, 2, 3))]
    assert isinstance(mismatches[0], BlockMismatch)
    loader.close()
