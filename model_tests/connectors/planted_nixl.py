"""A copy of vLLM's NixlConnector (pull) with a contract breach planted, for
``kvspec check --connector model_tests.connectors.planted_nixl:DropsDelayedFree``
(tests/test_connectors.py)."""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector


class DropsDelayedFree(NixlConnector):
    """Breach: a prefill node hands its blocks to the decode node (the
    ``kv_transfer_params`` it returns say where to pull from) but lets the
    scheduler free them at once (delay_covers_reads_in_flight). The released
    connector delays the free until the decode node's pull finishes."""

    def request_finished(self, request, block_ids):
        _, params = super().request_finished(request, block_ids)
        return False, params

    def request_finished_all_groups(self, request, block_ids):
        _, params = super().request_finished_all_groups(request, block_ids)
        return False, params
