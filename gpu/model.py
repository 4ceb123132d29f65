"""A tiny decoder-only transformer whose attention reads and writes the paged
KV cache through the scheduler's block tables, and the same model run with no
cache: the reference that says which tokens and logits a correct KV cache gives.

Random weights from a fixed seed (``torch.Generator``), nothing downloaded.
Grouped-query attention (``num_kv_heads < num_heads``), rotary position
embeddings (the cache holds K after rotation, as vLLM's does), RMS norms and a
GELU MLP, float32. With ``sliding_window > 0`` the odd layers attend only to
the last ``sliding_window`` positions (the token at ``p`` reads ``[p - w + 1,
p]``, as ``spec.groups`` reads a sliding-window group) and form KV cache group
1, the even layers group 0 (full attention): the layout kvspec calls
"sliding".

Both forwards share every op but attention's source of K/V: the paged one
writes the new tokens' K/V into the cache and reads the window of earlier
positions back through the block table, so K/V a load put in the cache (or
garbage a failed load wrote) is exactly what the model attends to.
"""
from __future__ import annotations

import math
from typing import Sequence

import attrs
import torch

from kvspec.gpu.paged_cache import PagedKVCache, get_device


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"TinyConfig.{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen
class TinyConfig:
    """Sizes of the tiny model. Defaults: 4 layers, 4 query heads sharing 2 KV
    heads, head dim 16, vocabulary 101."""

    vocab_size: int = attrs.field(default=101, validator=_positive)
    num_layers: int = attrs.field(default=4, validator=_positive)
    hidden_size: int = attrs.field(default=64, validator=_positive)
    num_heads: int = attrs.field(default=4, validator=_positive)
    num_kv_heads: int = attrs.field(default=2, validator=_positive)
    head_dim: int = attrs.field(default=16, validator=_positive)
    #: 0: every layer attends to every earlier position; w > 0: odd layers
    #: attend to the last w positions (KV cache group 1)
    sliding_window: int = attrs.field(default=0)
    seed: int = 0
    rope_theta: float = 10000.0

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding)")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"sliding_window={self.sliding_window!r} must be an integer >= 0")
        if self.sliding_window and self.num_layers < 2:
            raise ValueError("a sliding window needs at least 2 layers (one per group)")

    def get_layer_window(self, layer: int) -> int:
        """The layer's window in tokens, 0 for full attention."""
        return self.sliding_window if self.sliding_window and layer % 2 else 0

    def get_group_layers(self) -> tuple[tuple[int, ...], ...]:
        """The model layers of each KV cache group: full attention first."""
        layers = range(self.num_layers)
        if not self.sliding_window:
            return (tuple(layers),)
        return (tuple(layers[0::2]), tuple(layers[1::2]))


def compute_read_start(window: int, num_computed: int) -> int:
    """First earlier position a step starting at ``num_computed`` reads in a
    layer with this window (``spec.groups.compute_read_start`` for concrete
    numbers)."""
    return max(0, num_computed - window + 1) if window else 0


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyTransformer:
    """The model: weights on a device, no state between calls (the KV lives in
    the ``PagedKVCache`` passed to ``forward_paged``)."""

    def __init__(self, config: TinyConfig = TinyConfig(), device: str | torch.device = "cpu"):
        self.config = config
        self.device = get_device(device)
        self.weights = self._init_weights()
        half = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        self.inv_freq = (1.0 / config.rope_theta ** half).to(self.device)

    def _init_weights(self) -> dict[str, torch.Tensor]:
        """Gaussian weights scaled by 1/sqrt(fan_in), drawn on the CPU from the
        seed, so every device gets the same model."""
        c = self.config
        generator = torch.Generator().manual_seed(c.seed)

        def draw(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) / math.sqrt(shape[0])).to(self.device)

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        weights = {"embed": torch.randn(c.vocab_size, c.hidden_size,
                                        generator=generator).to(self.device)}
        for layer in range(c.num_layers):
            weights |= {f"{layer}.wq": draw(c.hidden_size, q_dim),
                        f"{layer}.wk": draw(c.hidden_size, kv_dim),
                        f"{layer}.wv": draw(c.hidden_size, kv_dim),
                        f"{layer}.wo": draw(q_dim, c.hidden_size),
                        f"{layer}.w1": draw(c.hidden_size, 4 * c.hidden_size),
                        f"{layer}.w2": draw(4 * c.hidden_size, c.hidden_size)}
        weights["lm_head"] = draw(c.hidden_size, c.vocab_size)
        return weights

    # -- cache ---------------------------------------------------------------

    def allocate_cache(self, num_blocks: int, block_size: int,
                       dtype: torch.dtype = torch.float32) -> PagedKVCache:
        """A pool shaped for this model: its KV heads, head dim and groups."""
        c = self.config
        return PagedKVCache.allocate(num_blocks, block_size, c.num_kv_heads, c.head_dim,
                                     c.get_group_layers(), dtype=dtype, device=self.device)

    def check_cache(self, cache: PagedKVCache) -> None:
        c = self.config
        ours = (c.num_kv_heads, c.head_dim, c.get_group_layers(), self.device)
        theirs = (cache.num_kv_heads, cache.head_dim, cache.group_layers, cache.device)
        if ours != theirs:
            raise ValueError(f"cache (kv heads, head dim, groups, device) {theirs} does not fit "
                             f"the model's {ours}")

    # -- forwards ------------------------------------------------------------

    @torch.inference_mode()
    def forward_reference(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits ``(len(tokens), vocab_size)`` of every position, no cache."""
        return self._run_reference(tokens)[0]

    @torch.inference_mode()
    def compute_reference_kv(self, tokens: Sequence[int]
                             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the K and V (each ``(len(tokens), num_kv_heads, head_dim)``,
        K after rotation) a correct cache holds for these tokens."""
        return self._run_reference(tokens)[1]

    @torch.inference_mode()
    def forward_paged(self, cache: PagedKVCache, tokens: Sequence[int],
                      block_tables: Sequence[Sequence[int]], num_computed: int,
                      positions: Sequence[int] | None = None) -> torch.Tensor:
        """Logits ``(len(tokens), vocab_size)`` of one request's new tokens at
        positions ``num_computed, num_computed + 1, ...``, reading the earlier
        positions' K/V from ``cache`` through ``block_tables`` (one per group)
        and writing the new tokens' K/V into it. ``positions``, if given, must
        be those positions (a scheduler step's positions are contiguous)."""
        self.check_cache(cache)
        new = self._check_positions(tokens, num_computed, positions)
        if len(block_tables) != cache.num_groups:
            raise ValueError(f"{len(block_tables)} block tables for {cache.num_groups} groups")
        x = self._embed(tokens)
        for layer in range(self.config.num_layers):
            table = block_tables[cache.get_group_of_layer(layer)]
            start = compute_read_start(self.config.get_layer_window(layer), num_computed)
            read = range(start, num_computed + len(tokens))

            def attend(q, k, v, layer=layer, table=table, read=read):
                cache.write(layer, table, new, k, v)
                keys, values = cache.gather(layer, table, read)
                return self._attention(layer, q, new, keys.float(), values.float(), read)

            x = self._layer(layer, x, new, attend)
        return self._logits(x)

    def _run_reference(self, tokens):
        positions = self._check_positions(tokens, 0, None)
        kv = []
        x = self._embed(tokens)
        for layer in range(self.config.num_layers):
            def attend(q, k, v, layer=layer):
                kv.append((k, v))
                return self._attention(layer, q, positions, k, v, positions)

            x = self._layer(layer, x, positions, attend)
        return self._logits(x), kv

    def _check_positions(self, tokens, num_computed, positions) -> range:
        if len(tokens) == 0:
            raise ValueError("no tokens to run")
        bad = [t for t in tokens if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token {bad[0]!r} is outside the vocabulary of "
                             f"{self.config.vocab_size}")
        if not isinstance(num_computed, int) or num_computed < 0:
            raise ValueError(f"num_computed={num_computed!r} must be an integer >= 0")
        new = range(num_computed, num_computed + len(tokens))
        if positions is not None and list(positions) != list(new):
            raise ValueError(f"positions {list(positions)} are not {num_computed}.."
                             f"{new[-1]} (one per token, after the computed prefix)")
        return new

    def _embed(self, tokens) -> torch.Tensor:
        return self.weights["embed"][torch.tensor(list(tokens), device=self.device)]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x) @ self.weights["lm_head"]

    def _layer(self, layer: int, x: torch.Tensor, positions: range, attend) -> torch.Tensor:
        c, w = self.config, self.weights
        h = _rms_norm(x)
        q = (h @ w[f"{layer}.wq"]).view(-1, c.num_heads, c.head_dim)
        k = (h @ w[f"{layer}.wk"]).view(-1, c.num_kv_heads, c.head_dim)
        v = (h @ w[f"{layer}.wv"]).view(-1, c.num_kv_heads, c.head_dim)
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        x = x + attend(q, k, v).reshape(len(positions), -1) @ w[f"{layer}.wo"]
        mlp = torch.nn.functional.gelu(_rms_norm(x) @ w[f"{layer}.w1"]) @ w[f"{layer}.w2"]
        return x + mlp

    def _rotate(self, x: torch.Tensor, positions: range) -> torch.Tensor:
        """Rotary embedding at the given positions (GPT-J form: adjacent pairs rotate)."""
        angles = torch.outer(torch.arange(positions.start, positions.stop, device=self.device,
                                          dtype=torch.float32), self.inv_freq)
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        first, second = x[..., 0::2], x[..., 1::2]
        return torch.stack((first * cos - second * sin, first * sin + second * cos),
                           dim=-1).flatten(-2)

    def _attention(self, layer: int, q: torch.Tensor, q_positions: range, keys: torch.Tensor,
                   values: torch.Tensor, k_positions: range) -> torch.Tensor:
        """Causal (and windowed) attention of the queries over the keys; the KV
        heads are shared by ``num_heads / num_kv_heads`` query heads each."""
        c = self.config
        share = c.num_heads // c.num_kv_heads
        keys, values = keys.repeat_interleave(share, dim=1), values.repeat_interleave(share, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(c.head_dim)
        qp = torch.arange(q_positions.start, q_positions.stop, device=self.device)[:, None]
        kp = torch.arange(k_positions.start, k_positions.stop, device=self.device)[None, :]
        visible = kp <= qp
        window = c.get_layer_window(layer)
        if window:
            visible &= kp > qp - window
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), values)
