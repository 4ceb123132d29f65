"""A copy of vLLM's SimpleCPUOffloadConnector with a contract breach planted
in its scheduler side, for ``kvspec check --connector
model_tests.connectors.planted_simple_cpu:CLASS`` (tests/test_connectors.py).
It changes one thing and says what it breaks; kvspec plays the worker."""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector)


class CountsPastStored(SimpleCPUOffloadConnector):
    """Breach: a hit counted one block past what the CPU cache holds, still
    short of the last token (hit_within_stored)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        found, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not found:
            return found, is_async
        size = self._vllm_config.cache_config.block_size
        room = request.num_tokens - 1 - num_computed_tokens
        return min(found + size, max(room, found)), is_async
