"""Copies of vLLM's ExampleConnector with contract breaches planted, for
``kvspec check --connector model_tests.connectors.planted_example:CLASS``
(tests/test_connectors.py). Each changes one scheduler-side answer and says
what it breaks; none touches the worker side, which kvspec plays.

``ExampleStoringComputed`` is the base of the planted copies: the released
ExampleConnector breaks contract claims of its own (docs/connectors.md): it
saves a new request's whole prompt during its first step, so under chunked
prefill it saves positions not computed yet (``store_reads_computed_kv``);
its lookup keys a prompt by ``(n - 2) // block * block`` tokens while its
store and load key it by ``(n - 1) // block * block``, so a hit can load a
prefix never saved (``load_reads_what_was_stored``) and can be negative
(``hit_within_uncomputed_tokens``: a one-token prompt finds the folder of the
empty prefix). The copy keys lookups as it stores, never answers below zero,
and saves a prompt only in the step that computes the last position it saves,
so that what a planted breach's check finds is the breach, not those
findings.
"""
from __future__ import annotations

import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class ExampleStoringComputed(ExampleConnector):
    """ExampleConnector saving a prompt only once the step computes all of it,
    and never answering a negative hit."""

    def get_saved_length(self, prompt) -> int:
        """How many tokens of a prompt a store saves: whole blocks, short of
        the last token (``ReqMeta.make_meta``)."""
        return (len(prompt) - 1) // self._block_size * self._block_size

    def _found_match_for_prompt(self, prompt_token_ids, mm_hashes):
        n = self.get_saved_length(prompt_token_ids)
        folder = self._generate_foldername_debug(torch.tensor(prompt_token_ids)[:n],
                                                 mm_hashes, create_folder=False)
        return os.path.exists(folder)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self._found_match_for_request(request):
            return 0, False
        return max(0, self.get_saved_length(request.prompt_token_ids) - num_computed_tokens), False

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        # a save keeps the request's first step's blocks: matched to its
        # request by those blocks (twins sharing a prefix share only cached ones)
        reach = [(r.block_ids[0], r.num_computed_tokens
                  + scheduler_output.num_scheduled_tokens.get(r.req_id, 0))
                 for r in scheduler_output.scheduled_new_reqs]
        meta.requests = [req for req in meta.requests
                         if not req.is_store or self._computed_by_this_step(req, reach)]
        return meta

    def _computed_by_this_step(self, req, reach) -> bool:
        slots = [int(s) for s in req.slot_mapping.tolist()]
        blocks = [slots[i] // self._block_size for i in range(0, len(slots), self._block_size)]
        return any(list(ids[:len(blocks)]) == blocks and computed >= len(req.token_ids)
                   for ids, computed in reach)


class FullPromptSyncHit(ExampleStoringComputed):
    """Breach: a synchronous hit of the whole prompt (sync_hit_leaves_a_token).
    The released connector leaves the last token (``len(prompt) - 1``)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self._found_match_for_request(request):
            return 0, False
        return len(request.prompt_token_ids) - num_computed_tokens, False


class CountsPastStored(ExampleStoringComputed):
    """Breach: a hit counted one block past what was saved (hit_within_stored),
    still short of the last token."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        found, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not found:
            return found, is_async
        saved = self.get_saved_length(request.prompt_token_ids)
        longer = min(saved + self._block_size, len(request.prompt_token_ids) - 1)
        return longer - num_computed_tokens, is_async
