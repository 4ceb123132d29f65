"""Block checksums: whether the KV a block holds is the KV it should hold,
decided on the device for many blocks at once, with one small tensor copied
to the host per step.

Two kinds:

- **Checksums** (``compute_block_checksums``): per block, layer slot and K/V,
  a weighted sum ``S = sum w[p, h, d] * x[p, h, d]`` over the positions ``p``
  the block holds, in float64. Compared with the sum the no-cache reference's
  K/V give (``compute_expected_checksums``) within a tolerance: a chunked or
  loaded forward computes K/V with other matmul shapes than the reference, so
  its low bits differ, and a bit-exact expectation would need every block's
  chunking history (a loaded prefix was computed by another request). The
  tolerance is ``rtol * sum w |x|`` with ``x`` the expected K/V (see
  ``get_default_rtol``). The weights differ per position, head and dim, so
  content in the wrong slot, a swapped pair of positions or a stale layer
  shows; garbage of scale 1e3 is off by ~1e3 * sqrt(n) against a tolerance of
  ~1e-4 * n for n elements of scale 1.
- **Fingerprints** (``compute_fingerprints``): a bit-exact integer hash of a
  block's bytes, for comparing two copies of one block (the store's and the
  cache's after a load). The bytes are read as int16, weighted by integers
  below 2**15 and summed in int64: no term and no sum can overflow (a block of
  under 2**26 int16 words sums to under 2**56), and integer sums do not depend
  on the order of the reduction, so every device gives the same value.

The weights come from a fixed seed, drawn on the CPU in float64 (or int64)
and moved to the device, so the expected value computed on the host uses the
very same weights.
"""
from __future__ import annotations

import functools
from typing import Sequence

import attrs
import torch

from kvspec.gpu.paged_cache import PagedKVCache
from kvspec.spec.groups import NULL_BLOCK

CHECKSUM_SEED = 0x5EED
#: float64 elements one chunk of blocks may expand to: bounds the temporary (8 MiB),
#: small enough for the allocator to reuse it (fresh large buffers cost page
#: faults: 8x slower per block at 32 MiB on the CPU)
CHUNK_ELEMENTS = 1 << 20


def get_default_rtol(dtype: torch.dtype) -> float:
    """Relative tolerance of a checksum, against ``sum w |x|`` of the expected
    K/V.

    float32 (and float64) caches: the chunked forward's K/V differ from the
    reference's by reordered float32 reductions: a few ulp of the values they
    are computed from, about 1e-6 relative after 4 layers of the tiny model
    (1.5e-6 measured at most); 1e-4 leaves two orders of margin, and each
    element contributes at most ``w * |delta|`` to the sum. float16 / bfloat16
    caches: those small differences may flip the rounding to the cache dtype,
    by one ulp (``eps * |x|`` at most), so twice the dtype's eps."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2 * torch.finfo(dtype).eps
    return 1e-4


@functools.lru_cache(maxsize=16)
def _get_weights(block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(CHECKSUM_SEED)
    weights = 0.5 + torch.rand(block_size, num_kv_heads, head_dim, generator=generator,
                               dtype=torch.float64)
    return weights.to(device)


def get_checksum_weights(block_size: int, num_kv_heads: int, head_dim: int,
                         device: str | torch.device = "cpu") -> torch.Tensor:
    """``(block_size, num_kv_heads, head_dim)`` float64 weights in [0.5, 1.5)."""
    return _get_weights(block_size, num_kv_heads, head_dim, torch.device(device))


def _weighted_sums(blocks: torch.Tensor, weights: torch.Tensor,
                   num_valid: torch.Tensor) -> torch.Tensor:
    """``(n, slots, 2)`` sums of ``blocks`` ``(n, slots, 2, block_size, heads,
    dim)`` over their first ``num_valid[i]`` positions."""
    n, slots = blocks.shape[:2]
    positions = torch.arange(blocks.shape[3], device=blocks.device)
    held = (positions[None, :] < num_valid[:, None]).to(torch.float64)
    # the mask folds into each block's weights: one batched matrix-vector
    # product per chunk, (n, slots * 2, positions * heads * dim) @ (n, ..., 1)
    per_block = (weights[None] * held[:, :, None, None]).reshape(n, -1, 1)
    rows = blocks.to(torch.float64).reshape(n, slots * 2, -1)
    return torch.bmm(rows, per_block).view(n, slots, 2)


def compute_block_checksums(cache: PagedKVCache, block_ids: Sequence[int],
                            num_valid: Sequence[int] | None = None) -> torch.Tensor:
    """``(len(block_ids), num_layer_slots, 2)`` float64 checksums, on the
    cache's device, of the first ``num_valid[i]`` positions of each block
    (all of them by default: a block's later slots may hold stale KV)."""
    bs = cache.block_size
    num_valid = [bs] * len(block_ids) if num_valid is None else list(num_valid)
    if len(num_valid) != len(block_ids):
        raise ValueError(f"{len(num_valid)} num_valid counts for {len(block_ids)} blocks")
    if any(not isinstance(n, int) or not 0 <= n <= bs for n in num_valid):
        raise ValueError(f"num_valid {num_valid} must each be in 0..{bs}")
    index = cache.get_index(block_ids)
    valid = torch.tensor(num_valid, dtype=torch.long, device=cache.device)
    weights = get_checksum_weights(bs, cache.num_kv_heads, cache.head_dim, cache.device)
    chunk = max(1, CHUNK_ELEMENTS // cache.kv[0].numel())
    sums = [_weighted_sums(cache.kv.index_select(0, index[i:i + chunk]), weights,
                           valid[i:i + chunk])
            for i in range(0, len(block_ids), chunk)]
    if not sums:
        return torch.zeros((0, cache.num_layer_slots, 2), dtype=torch.float64,
                           device=cache.device)
    return torch.cat(sums)


def compute_expected_checksums(reference_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                               layers: Sequence[int], block_size: int, block_index: int,
                               num_valid: int, dtype: torch.dtype = torch.float32
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, scales)``, each ``(len(layers), 2)`` float64 on the CPU: the
    checksum a block at ``block_index`` of a table should have in the slots of
    ``layers`` (a group's layers, in slot order), from the reference K/V of the
    request's tokens (``TinyTransformer.compute_reference_kv``), rounded to the
    cache's ``dtype`` as the cache stores them; and ``sum w |x|``, the scale of
    the tolerance."""
    start = block_index * block_size
    if not 0 < num_valid <= block_size:
        raise ValueError(f"num_valid={num_valid} must be in 1..{block_size}")
    if start + num_valid > reference_kv[0][0].shape[0]:
        raise ValueError(f"block {block_index} holds positions up to {start + num_valid - 1}, "
                         f"the reference covers {reference_kv[0][0].shape[0]}")
    bad = [layer for layer in layers if not 0 <= layer < len(reference_kv)]
    if bad:
        raise ValueError(f"layer {bad[0]} is not in the reference ({len(reference_kv)} layers)")
    _, heads, dim = reference_kv[0][0].shape
    block = torch.zeros((1, len(layers), 2, block_size, heads, dim), dtype=torch.float64)
    for slot, layer in enumerate(layers):
        for kv_index, tensor in enumerate(reference_kv[layer]):
            rows = tensor[start:start + num_valid].to(dtype).to("cpu", torch.float64)
            block[0, slot, kv_index, :num_valid] = rows
    weights = get_checksum_weights(block_size, heads, dim)
    valid = torch.tensor([num_valid])
    return _weighted_sums(block, weights, valid)[0], _weighted_sums(block.abs(), weights, valid)[0]


@attrs.frozen
class ExpectedBlock:
    """What one block of one request should hold: the oracle's prediction."""

    request_id: str
    block_id: int
    #: index of the block in the request's table for its group
    block_index: int
    group: int
    #: leading positions of the block that hold KV (the rest is not checked)
    num_valid: int
    sums: torch.Tensor
    scales: torch.Tensor


@attrs.frozen
class BlockMismatch:
    """A block that does not hold the KV it should, at a step."""

    step: int
    request_id: str
    block_id: int
    block_index: int
    group: int
    #: model layers whose K or V is off
    layers: tuple[int, ...]
    #: largest |checksum - expected| / tolerance over those layers
    worst: float

    def __str__(self) -> str:
        return (f"step {self.step}: block {self.block_id} (index {self.block_index}, group "
                f"{self.group}) of request {self.request_id} holds the wrong KV in layers "
                f"{list(self.layers)} ({self.worst:.3g}x the tolerance)")


def get_expected_blocks(reference_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                        cache: PagedKVCache, request_id: str, group: int,
                        block_table: Sequence[int], num_tokens: int) -> list[ExpectedBlock]:
    """The expectation for every block of a request's table in ``group`` that
    holds one of its first ``num_tokens`` positions (null blocks skipped)."""
    if not 0 <= group < cache.num_groups:
        raise ValueError(f"group {group!r} is not one of the cache's {cache.num_groups}")
    layers, bs = cache.group_layers[group], cache.block_size
    expected = []
    for index, block_id in enumerate(block_table):
        num_valid = min(bs, num_tokens - index * bs)
        if num_valid <= 0:
            break
        if block_id == NULL_BLOCK:
            continue
        sums, scales = compute_expected_checksums(reference_kv, layers, bs, index, num_valid,
                                                  cache.dtype)
        expected.append(ExpectedBlock(request_id, block_id, index, group, num_valid, sums, scales))
    return expected


def check_blocks(cache: PagedKVCache, expected: Sequence[ExpectedBlock], step: int,
                 rtol: float | None = None, atol: float = 1e-6) -> list[BlockMismatch]:
    """The blocks whose checksums disagree with the expectation: one device
    pass over every listed block, one copy of the ``(n, slots, 2)`` sums to
    the host. ``atol`` keeps an all-zero expectation from demanding exact
    zeros."""
    rtol = get_default_rtol(cache.dtype) if rtol is None else rtol
    actual = compute_block_checksums(cache, [e.block_id for e in expected],
                                     [e.num_valid for e in expected]).cpu()
    mismatches = []
    for sums, e in zip(actual, expected):
        layers = cache.group_layers[e.group]
        error = (sums[:len(layers)] - e.sums).abs() / (rtol * e.scales + atol)
        off = error.amax(dim=1) > 1  # per layer slot, K or V
        if off.any():
            bad_layers = tuple(layers[j] for j in off.nonzero().flatten().tolist())
            mismatches.append(BlockMismatch(step, e.request_id, e.block_id, e.block_index, e.group,
                                            bad_layers, float(error.max())))
    return mismatches


# -- fingerprints --------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _get_fingerprint_weights(num_words: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(CHECKSUM_SEED + 1)
    return torch.randint(1, 1 << 15, (num_words,), generator=generator,
                         dtype=torch.int64).to(device)


def compute_fingerprints(blocks: torch.Tensor) -> torch.Tensor:
    """``(n,)`` int64 bit-exact fingerprints of ``n`` blocks (any shape after
    the first dimension, any dtype of even byte size), on their device."""
    if blocks.element_size() % 2:
        raise ValueError(f"fingerprints need a dtype of even byte size, not {blocks.dtype}")
    words = blocks.contiguous().view(torch.int16).reshape(blocks.shape[0], -1)
    if words.shape[1] >= 1 << 26:
        raise ValueError(f"a block of {words.shape[1]} int16 words could overflow the fingerprint")
    weights = _get_fingerprint_weights(words.shape[1], blocks.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, words.shape[1]))
    return torch.cat([(words[i:i + chunk].to(torch.int64) * weights).sum(1)
                      for i in range(0, blocks.shape[0], chunk)]
                     or [torch.zeros(0, dtype=torch.int64, device=blocks.device)])


def compute_block_fingerprints(cache: PagedKVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """Fingerprints of cache blocks, on the cache's device, a few blocks at a
    time (no copy of the whole batch)."""
    index = cache.get_index(block_ids)
    chunk = max(1, CHUNK_ELEMENTS // cache.kv[0].numel())
    return torch.cat([compute_fingerprints(cache.kv.index_select(0, index[i:i + chunk]))
                      for i in range(0, len(block_ids), chunk)]
                     or [torch.zeros(0, dtype=torch.int64, device=cache.device)])
