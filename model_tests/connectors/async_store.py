"""A small out-of-tree connector that keeps its contract: a prefix store whose
hits are all loaded asynchronously, and which holds every finished request's
blocks for a send (tests/test_connectors.py).

Unlike kvspec's own connector, it asks to keep the blocks of a request
aborted while its load is still in flight, so the scheduler's blocks wait for
two transfers: vLLM (with the abort-mid-load fix) frees them at the later of
the two reports, whichever comes first."""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata)


class _Loads(KVConnectorMetadata):
    def __init__(self, loads: dict[str, int]) -> None:
        self.loads = loads


class AsyncPrefixStore(KVConnectorBase_V1):
    """Stores each finished request's computed prompt blocks; offers the longest
    stored whole-block prefix short of the prompt's last token, as an async load."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.stored: set[tuple[int, ...]] = set()
        self.pending: dict[str, int] = {}

    # the worker side: kvspec's environment plays it
    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    # the scheduler side
    def get_stored_prefix(self, tokens, limit: int) -> int:
        """The longest stored whole-block prefix of ``tokens`` ending by ``limit``."""
        found = 0
        for end in range(self.block_size, limit + 1, self.block_size):
            if tuple(tokens[:end]) not in self.stored:
                break
            found = end
        return found

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        prompt = list(request.prompt_token_ids)  # a hit leaves at least one token
        hit = max(0, self.get_stored_prefix(prompt, len(prompt) - 1) - num_computed_tokens)
        return hit, hit > 0

    def kvspec_stored_end(self, request, start: int) -> int:
        """For kvspec only (docs/connectors.md): where the run of the request's
        tokens the store holds from ``start`` ends, read from the store."""
        tokens = list(request.all_token_ids)
        return max(start, self.get_stored_prefix(tokens, len(tokens)))

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        if num_external_tokens > 0:
            self.pending[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self.pending = _Loads(self.pending), {}
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        prompt = list(request.prompt_token_ids)
        computed = min(request.num_computed_tokens, len(prompt))
        for end in range(self.block_size, computed + 1, self.block_size):
            self.stored.add(tuple(prompt[:end]))
        return bool(block_ids), None


class AsyncWithoutTokens(AsyncPrefixStore):
    """Breach: every answer asks for an async load, with no tokens too
    (async_load_has_tokens); vLLM asserts on the first such request."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hit, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return hit, True


class AnswersACount(AsyncPrefixStore):
    """Breach: answers the count alone, not the pair
    (lookup_answer_has_the_api_types)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return super().get_num_new_matched_tokens(request, num_computed_tokens)[0]


class AnswersAString(AsyncPrefixStore):
    """Breach: the right shape, the count as a string
    (lookup_answer_has_the_api_types)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return str(hit), is_async


class SwapsThePair(AsyncPrefixStore):
    """Breach: the flag first, the count second (lookup_answer_has_the_api_types)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return is_async, hit


class OffersMoreThanStored(AsyncPrefixStore):
    """Bug: a hit one block past its stored prefix, where the prompt has room
    (hit_within_stored, judged by ``kvspec_stored_end``)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if hit and num_computed_tokens + hit + self.block_size < request.num_tokens:
            hit += self.block_size
        return hit, is_async


class StoreProbeOutOfRange(AsyncPrefixStore):
    """A broken probe: it answers a position past the request's tokens."""

    def kvspec_stored_end(self, request, start: int) -> int:
        return request.num_tokens + 1


class StoreProbeRaises(AsyncPrefixStore):
    """A broken probe: it raises (the connector's fault, not vLLM's crash)."""

    def kvspec_stored_end(self, request, start: int) -> int:
        raise KeyError("store offline")


class NoStoreProbe(AsyncPrefixStore):
    """The same store, not shown to kvspec: hit_within_stored is not judged."""

    kvspec_stored_end = None


class NeverDecides(AsyncPrefixStore):
    """A connector bug no claim of the contract can pin on one call: it answers
    "not known yet" for ever for a prompt it holds, so the request waits for
    ever (every_request_finishes; the message names the answer)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (None, False) if hit else (hit, is_async)


class FinishesWithABool(AsyncPrefixStore):
    """Breach: ``request_finished`` answers a bare bool, not the pair
    (finish_answer_has_the_api_types); vLLM's unpacking raised a TypeError."""

    def request_finished(self, request, block_ids):
        return super().request_finished(request, block_ids)[0]


class _Reports(AsyncPrefixStore):
    """Keeps the async loads it was given, for ``update_connector_output``."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.loading: set[str] = set()
        self.held: set[str] = set()

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            self.loading.add(request.request_id)


class ReportsLoadEarly(_Reports):
    """Breaks the contract: names its loads finished at the next report,
    before the worker says so (the scheduler then computes on KV not landed)."""

    def update_connector_output(self, connector_output) -> None:
        early, self.loading = self.loading, set()
        connector_output.finished_recving = set(connector_output.finished_recving or ()) | early


class HoldsBackLoadsOnce(_Reports):
    """Keeps its contract: passes each finished load on one report late (the
    API allows a connector to reconcile the worker's report)."""

    def update_connector_output(self, connector_output) -> None:
        now = set(connector_output.finished_recving or ())
        connector_output.finished_recving = self.held or None
        self.held = now


class DropsFinishedLoads(_Reports):
    """Breaks the contract by omission: takes every finished load out of the
    worker's report and never passes it on, so its requests wait forever."""

    def update_connector_output(self, connector_output) -> None:
        connector_output.finished_recving = None


class AnswersANumpyCount(AsyncPrefixStore):
    """Keeps its contract: counts with numpy (base.py's ``int``; numpy's
    integers are integers), as a store that computes hits with arrays may."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        import numpy as np
        hit, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return np.int64(hit), is_async


class ForgetsTheMeta(AsyncPrefixStore):
    """Breaks the contract: its ``build_connector_meta`` forgets to return
    (vLLM's worker asserts the step's metadata is there)."""

    def build_connector_meta(self, scheduler_output):
        self.pending = {}
