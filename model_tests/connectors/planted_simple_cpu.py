"""A copy of vLLM's SimpleCPUOffloadConnector with a contract breach planted
in its scheduler side, for ``kvspec check --connector
model_tests.connectors.planted_simple_cpu:CLASS`` (tests/test_connectors.py).
It changes one thing and says what it breaks; kvspec plays the worker."""
from __future__ import annotations

from model_tests.connectors.breaches import CountsOneBlockPast
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector)


class CountsPastStored(CountsOneBlockPast, SimpleCPUOffloadConnector):
    """Breach: a hit counted one block past what the CPU cache holds, still
    short of the last token (hit_within_stored)."""
