"""The paged KV cache: one physical block per scheduler block id, K and V for
every attention layer, on the CPU or on a CUDA device.

Layout. One tensor holds the whole pool::

    kv: (num_blocks, num_layer_slots, 2, block_size, num_kv_heads, head_dim)

Block ``b`` is ``kv[b]``: the K (index 0) and V (index 1) of every layer slot,
contiguous, so a block moves between the cache and the external store as one
contiguous copy (vLLM's cross-layer block layout, which its CPU offloading
uses for the same reason). Per layer, ``get_key_cache(layer)`` and
``get_value_cache(layer)`` are views of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``, the shape attention reads.

KV cache groups. Each group is a tuple of model layers (``group_layers``); the
``j``-th layer of every group uses layer slot ``j`` of the blocks its group's
block table names. All groups share one pool, as in vLLM's hybrid KV cache
manager, where layer ``j`` of every group shares one tensor: a block id held by
two groups at once is a real clobber here too, not a bug the layout hides.

Block tables are lists of block ids, block ``i`` holding positions
``[i * block_size, (i + 1) * block_size)``; ``NULL_BLOCK`` (-1) marks a block a
windowed group gave back, which is neither read nor written.
"""
from __future__ import annotations

import operator
from typing import Sequence

import attrs
import torch

from kvspec.spec.groups import NULL_BLOCK

#: index of K and V along the cache's third dimension
KEY, VALUE = 0, 1


def get_device(device: str | torch.device) -> torch.device:
    """A torch device from a name; ``ValueError`` for an unknown device or a
    CUDA device this machine does not have."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: only cpu and cuda are supported") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA device on this machine")
        index = resolved.index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices")
        return torch.device("cuda", index)
    if resolved.type != "cpu":
        raise ValueError(f"device {device!r}: only cpu and cuda are supported")
    return resolved


def compute_slot_mapping(block_table: Sequence[int], positions: Sequence[int],
                         block_size: int) -> tuple[list[int], list[int]]:
    """``(block_ids, offsets)`` of each position: the block the table names for
    it and the slot inside that block. ``ValueError`` for a position past the
    table or in a block the group gave back."""
    block_ids, offsets = [], []
    for position in positions:
        index = position // block_size
        if position < 0 or index >= len(block_table):
            raise ValueError(f"position {position} is outside a block table of "
                             f"{len(block_table)} blocks of {block_size}")
        block_id = block_table[index]
        if block_id == NULL_BLOCK:
            raise ValueError(f"position {position} lies in block {index}, which the group gave "
                             "back (NULL_BLOCK)")
        block_ids.append(block_id)
        offsets.append(position % block_size)
    return block_ids, offsets


def _is_index(value) -> bool:
    """An integer (Python, numpy or a 0-d integer tensor), not a bool."""
    if isinstance(value, bool) or isinstance(value, float):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _check_group_layers(group_layers) -> tuple[tuple[int, ...], ...]:
    groups = tuple(tuple(int(layer) for layer in group) for group in group_layers)
    layers = [layer for group in groups for layer in group]
    if not groups or any(not group for group in groups):
        raise ValueError(f"group_layers {group_layers!r}: every group needs at least one layer")
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(f"group_layers {group_layers!r}: the layers must be 0..n-1, each once")
    return groups


@attrs.define(eq=False)
class PagedKVCache:
    """The pool of KV blocks of every group (see the module docstring)."""

    kv: torch.Tensor = attrs.field(repr=lambda t: f"<{tuple(t.shape)} {t.dtype} {t.device}>")
    group_layers: tuple[tuple[int, ...], ...] = attrs.field(converter=_check_group_layers)
    #: model layer -> (group, layer slot)
    _placement: dict[int, tuple[int, int]] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.kv.dim() != 6 or self.kv.shape[2] != 2:
            raise ValueError(f"kv of shape {tuple(self.kv.shape)} is not (num_blocks, "
                             "num_layer_slots, 2, block_size, num_kv_heads, head_dim)")
        slots = max(len(group) for group in self.group_layers)
        if self.kv.shape[1] != slots:
            raise ValueError(f"kv has {self.kv.shape[1]} layer slots, the groups need {slots}")
        self._placement = {layer: (g, j) for g, group in enumerate(self.group_layers)
                           for j, layer in enumerate(group)}

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 group_layers: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> "PagedKVCache":
        """A zeroed pool. ``group_layers``: the model layers of each group, e.g.
        ``[[0, 1, 2, 3]]`` for one full-attention group."""
        sizes = dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                     head_dim=head_dim)
        bad = [f"{name}={value!r}" for name, value in sizes.items()
               if not isinstance(value, int) or isinstance(value, bool) or value < 1]
        if bad:
            raise ValueError(f"cache sizes must be positive integers: {', '.join(bad)}")
        groups = _check_group_layers(group_layers)
        slots = max(len(group) for group in groups)
        kv = torch.zeros(num_blocks, slots, 2, block_size, num_kv_heads, head_dim,
                         dtype=dtype, device=get_device(device))
        return cls(kv, groups)

    # -- shape ---------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[0]

    @property
    def num_layer_slots(self) -> int:
        return self.kv.shape[1]

    @property
    def block_size(self) -> int:
        return self.kv.shape[3]

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[4]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[5]

    @property
    def num_groups(self) -> int:
        return len(self.group_layers)

    @property
    def num_layers(self) -> int:
        return len(self._placement)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: (num_layer_slots, 2, block_size, num_kv_heads, head_dim)."""
        return tuple(self.kv.shape[1:])

    def get_block_nbytes(self) -> int:
        return self.kv[0].numel() * self.kv.element_size()

    # -- per layer -----------------------------------------------------------

    def get_placement(self, layer: int) -> tuple[int, int]:
        """``(group, layer_slot)`` of a model layer."""
        if layer not in self._placement:
            raise ValueError(f"layer {layer!r} is not in the cache "
                             f"(layers 0..{self.num_layers - 1})")
        return self._placement[layer]

    def get_group_of_layer(self, layer: int) -> int:
        return self.get_placement(layer)[0]

    def get_key_cache(self, layer: int) -> torch.Tensor:
        """``(num_blocks, block_size, num_kv_heads, head_dim)`` view of a layer's K."""
        return self.kv[:, self.get_placement(layer)[1], KEY]

    def get_value_cache(self, layer: int) -> torch.Tensor:
        return self.kv[:, self.get_placement(layer)[1], VALUE]

    def write(self, layer: int, block_table: Sequence[int], positions: Sequence[int],
              key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the K/V of ``positions`` (each ``(len(positions), num_kv_heads,
        head_dim)``) into the slots the block table maps them to."""
        expected = (len(positions), self.num_kv_heads, self.head_dim)
        for name, tensor in (("key", key), ("value", value)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} of shape {tuple(tensor.shape)}, expected {expected}")
        block_ids, offsets = self._get_slots(block_table, positions)
        slot = self.get_placement(layer)[1]
        self.kv[:, slot, KEY].index_put_((block_ids, offsets), key.to(self.device, self.dtype))
        self.kv[:, slot, VALUE].index_put_((block_ids, offsets),
                                           value.to(self.device, self.dtype))

    def gather(self, layer: int, block_table: Sequence[int],
               positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``positions`` read through the block table, each
        ``(len(positions), num_kv_heads, head_dim)``."""
        block_ids, offsets = self._get_slots(block_table, positions)
        slot = self.get_placement(layer)[1]
        return (self.kv[:, slot, KEY][block_ids, offsets],
                self.kv[:, slot, VALUE][block_ids, offsets])

    def _get_slots(self, block_table, positions) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_block_ids([b for b in block_table if b != NULL_BLOCK])
        block_ids, offsets = compute_slot_mapping(block_table, positions, self.block_size)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(block_ids), as_tensor(offsets)

    # -- whole blocks (all layer slots, K and V) -----------------------------

    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        """``ValueError`` naming the first block id outside the pool."""
        for block_id in block_ids:
            if not _is_index(block_id) or not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id!r} is outside the pool of "
                                 f"{self.num_blocks} blocks")

    def get_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The block ids as an index tensor on the cache's device (checked)."""
        self.check_block_ids(block_ids)
        return torch.tensor([operator.index(b) for b in block_ids], dtype=torch.long,
                            device=self.device)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of the blocks, ``(len(block_ids), *block_shape)``, on the device."""
        return self.kv.index_select(0, self.get_index(block_ids))

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Overwrite whole blocks with ``blocks`` of shape ``(len(block_ids),
        *block_shape)`` in one batched copy."""
        expected = (len(block_ids), *self.block_shape)
        if tuple(blocks.shape) != expected:
            raise ValueError(f"blocks of shape {tuple(blocks.shape)}, expected {expected}")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"block ids {list(block_ids)} repeat a block")
        index = self.get_index(block_ids)
        self.kv.index_copy_(0, index, blocks.to(device=self.device, dtype=self.dtype))

    def copy_blocks(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> None:
        """Copy each source block onto its destination (vLLM's ``copy_blocks``),
        all at once: the sources are read before any destination is written."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(f"{len(src_block_ids)} source blocks but "
                             f"{len(dst_block_ids)} destinations")
        self.write_blocks(dst_block_ids, self.read_blocks(src_block_ids))
