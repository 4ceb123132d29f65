"""Contract breaches that fit any connector's scheduler side, planted by
mixing one in front of the connector class (``planted_*.py``)."""
from __future__ import annotations


class CountsOneBlockPast:
    """Breach: a hit counted one block past what the store holds, still short
    of the last token (hit_within_stored)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        found, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not found:
            return found, is_async
        size = self._vllm_config.cache_config.block_size
        room = request.num_tokens - 1 - num_computed_tokens
        return min(found + size, max(room, found)), is_async
