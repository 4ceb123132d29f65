"""What the scheduler hands the worker, and what comes back."""
from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    num_computed_before: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]]
    new_req_ids: list[str]
    resumed_req_ids: list[str]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    block_ids: dict[str, tuple[list[int], ...]]
    kv_connector_metadata: Any = None
    #: what the worker is told of each scheduled request's blocks (vLLM's
    #: ``new_block_ids``): a new or resumed request's whole table, another's
    #: blocks allocated since it was last told (None: none)
    new_block_ids: dict[str, tuple[tuple[int, ...], ...] | None] = attrs.Factory(dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@attrs.define
class KVConnectorOutput:
    finished_recving: set[str] = attrs.Factory(set)
    finished_sending: set[str] = attrs.Factory(set)
    invalid_block_ids: set[int] = attrs.Factory(set)


@attrs.define
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]]
    kv_connector_output: KVConnectorOutput = attrs.Factory(KVConnectorOutput)
