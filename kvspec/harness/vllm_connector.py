"""The KV connector kvspec registers in vLLM through ``kv_connector_module_path``.

vLLM builds its connector itself, from a module path and a class name, so the
scheduler side cannot be handed an object. The target binds the environment's
:class:`~kvspec.harness.env.EnvConnector` (and the block-id translation) in
``CURRENT_BINDING`` just before it constructs the ``Scheduler``; the connector
captures that binding in ``__init__`` and from then on asks the environment
every question vLLM asks it: how many external tokens, sync or async, "not yet"
(None), and whether a finished request's blocks are held for a send.

Only the scheduler role is used: the worker role has no model to run, so its
methods do nothing. Importing this module imports vLLM.
"""
from __future__ import annotations

from typing import Any, Callable

import attrs

from kvspec.harness.vllm_observe import as_groups
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata)


@attrs.define
class Binding:
    """What one scheduler's connector talks to."""

    #: the environment's programmable connector (kvspec.harness.env.EnvConnector)
    env: Any
    #: vLLM block ids of one group (and the group's index) -> kvspec block ids
    #: (the target renumbers past the null block, which it maps to NULL_BLOCK)
    to_spec_ids: Callable[[list[int], int], tuple[int, ...]]
    #: called with the request id when vLLM tells the connector a request finished
    on_finished: Callable[[str, bool], None] = lambda request_id, delay: None
    #: called with the request id and the (kvspec) block ids a load will write
    on_load: Callable[[str, tuple], None] = lambda request_id, block_ids: None
    #: the connector's ``requires_kv_delivery`` (kvspec's Config); None: the
    #: release's default (the producer role)
    requires_kv_delivery: bool | None = None


#: set by the target right before it constructs a Scheduler; read once by __init__
CURRENT_BINDING: Binding | None = None


class KVSpecConnectorMetadata(KVConnectorMetadata):
    """Nothing goes to the workers: the harness plays the worker itself."""


class KVSpecConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector whose answers come from kvspec's environment."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if CURRENT_BINDING is None:
            raise RuntimeError("KVSpecConnector built without a kvspec binding: construct "
                               "the scheduler through kvspec.harness.vllm_target.VllmTarget")
        self.binding = CURRENT_BINDING

    @property
    def requires_kv_delivery(self) -> bool:
        """As configured: a best-effort cache opts out, as vLLM's offloading
        connectors do."""
        if self.binding.requires_kv_delivery is None:
            return self._kv_transfer_config.is_kv_producer
        return self.binding.requires_kv_delivery

    # -- scheduler side: every answer comes from the environment ---------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.binding.env.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        groups = blocks.get_block_ids()
        block_ids = tuple(self.binding.to_spec_ids(list(ids), g) for g, ids in enumerate(groups))
        if num_external_tokens > 0:
            self.binding.on_load(request.request_id, block_ids)
        self.binding.env.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self.binding.env.build_connector_meta(scheduler_output)
        return KVSpecConnectorMetadata()

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        spec_ids = tuple(self.binding.to_spec_ids(list(ids), g)
                         for g, ids in enumerate(as_groups(block_ids)))
        delay, params = self.binding.env.request_finished(request, spec_ids)
        self.binding.on_finished(request.request_id, bool(delay))
        return delay, params

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids)

    # -- worker side: unused (the harness plays the worker) -------------------
    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


class KVSpecHMAConnector(KVSpecConnector, _base.SupportsHMA):
    """The same connector, declaring support for the hybrid KV cache manager
    (several KV cache groups): vLLM then hands every group's blocks to
    ``request_finished_all_groups``."""
