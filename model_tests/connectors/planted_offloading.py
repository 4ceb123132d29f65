"""Copies of vLLM's OffloadingConnector with contract breaches planted in its
scheduler side, for ``kvspec check --connector
model_tests.connectors.planted_offloading:CLASS`` (tests/test_connectors.py).
Each changes one thing and says what it breaks; kvspec plays the worker.

They derive from ``OffloadingResetFixed``: vLLM 0.32.0's connector asserts
(``assert self._jobs[any_jid].is_store``) when a forced prefix-cache reset
preempts a request that the next step re-admits with a hit on its own
offloaded KV (kvspec's finding, docs/connectors.md; 0.33.0 skips the step's
new loads there). The base carries 0.33.0's remedy, so that what a planted
breach's check finds is the breach."""
from __future__ import annotations

from model_tests.connectors.breaches import CountsOneBlockPast
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector)


class OffloadingResetFixed(OffloadingConnector):
    """0.33.0's remedy: the loads a step starts for a request it also reports
    preempted are not flushed as that request's old jobs."""

    def build_connector_meta(self, scheduler_output):
        scheduler = self.connector_scheduler
        hidden = {}
        for rid in scheduler_output.preempted_req_ids or ():
            status = scheduler._req_status.get(rid)
            new = (status.transfer_jobs & scheduler._current_batch_load_jobs.keys()
                   if status is not None else set())
            if new:
                hidden[rid] = new
                status.transfer_jobs -= new
        try:
            return super().build_connector_meta(scheduler_output)
        finally:
            for rid, jobs in hidden.items():
                status = scheduler._req_status.get(rid)
                if status is not None:
                    status.transfer_jobs |= jobs


class FullPromptSyncHit(OffloadingResetFixed):
    """Breach: a hit is answered as a synchronous load of the whole prompt
    (sync_hit_leaves_a_token). The released connector loads asynchronously."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        found, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not found:
            return found, is_async
        return request.num_tokens - num_computed_tokens, False


class CountsPastStored(CountsOneBlockPast, OffloadingResetFixed):
    """Breach: a hit counted one block past what the CPU cache holds, still
    short of the last token (hit_within_stored)."""


class DropsDeferredFence(OffloadingResetFixed):
    """Breach: a finished request's stores still in flight lose their fence
    (the offloading connector's form of a delayed free: it never delays, it
    asks the worker to flush a store before its blocks are reused). The
    scheduler may then hand the blocks to another request while the store
    still reads them (store_reads_computed_kv)."""

    def request_finished(self, request, block_ids):
        return self._unfenced(super().request_finished(request, block_ids), request)

    def request_finished_all_groups(self, request, block_ids):
        return self._unfenced(super().request_finished_all_groups(request, block_ids), request)

    def _unfenced(self, answer, request):
        scheduler = self.connector_scheduler
        status = scheduler._req_status.get(request.request_id)
        for job_id in (status.transfer_jobs if status is not None else ()):
            job = scheduler._jobs[job_id]
            for block in job.deferred_fence_block_ids or ():
                fenced = scheduler._block_id_to_pending_jobs.get(block)
                if fenced is not None:
                    fenced.discard(job_id)
                    if not fenced:
                        del scheduler._block_id_to_pending_jobs[block]
        return answer
