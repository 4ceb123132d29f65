"""Where each claim lives in vLLM 0.32: the functions and fields a change would
have to touch to break it. Paths are relative to the ``vllm`` package; line
numbers drift between releases, function names rarely do. ``docs/spec.md``
renders this beside each claim; a test fails when a claim has no entry.
"""
from __future__ import annotations

S = "v1/core/sched/scheduler.py"
KM = "v1/core/kv_cache_manager.py"
BP = "v1/core/block_pool.py"

#: claim -> the vLLM 0.32 functions and fields it constrains
CONSTRAINS: dict[str, str] = {
    "add_relation": f"`Scheduler.add_request` ({S}), `Request.__init__` (v1/request.py): a new "
                    "id starts WAITING with `num_computed_tokens` 0 and an empty `PrefillStats`.",
    "long_prefill_cap": f"`Scheduler.schedule` ({S}): `long_prefill_token_threshold`, lifted when "
                        "`get_request_counts()` sums to one, applied to running requests and to "
                        "admissions alike; `long_prefill_token_threshold_adaptive` (off by default).",
    "preemption_victim_follows_policy": f"`Scheduler.schedule` ({S}): the victim of a failed "
                                        "allocation, `running[-1]` under FCFS, "
                                        "`max(running, key=(priority, arrival_time))` under "
                                        "PRIORITY; `_preempt_request`.",
    "preemption_stops_at_fenced_victim": f"`Scheduler.schedule` ({S}): the allocation retry "
                                         "stops at a victim `_request_blocks_can_be_freed` "
                                         "refuses (frees deferred behind the step in flight, "
                                         "`deferred_frees`, `defer_block_free`).",
    "schedule_relation": f"`Scheduler.schedule`, `_preempt_request`, `_update_after_schedule` "
                         f"({S}): token budget, `max_model_len` clip, spec-decode padding, "
                         "victim choice (`running[-1]` or the worst priority), "
                         "`scheduled_new_reqs` vs `resumed_req_ids`, the requests preempted "
                         "in the call (read off `num_preemptions`: the output's "
                         "`preempted_req_ids` also names those a forced reset preempted since "
                         "the last step), "
                         "`num_computed_tokens` at the start of a running request's step.",
    "worker_tables_match_scheduler": f"`Scheduler._make_cached_request_data` ({S}) and "
                                     "`NewRequestData.from_request` (v1/core/sched/output.py): "
                                     "`new_block_ids` (the blocks `allocate_slots` returned), "
                                     "`resumed_req_ids` (the worker replaces the table), "
                                     "`scheduled_new_reqs[].block_ids`.",
    "update_from_output_relation": f"`Scheduler.update_from_output`, "
                                   f"`_update_request_with_output`, `_update_from_kv_xfer_finished` "
                                   f"({S}); `check_stop` (v1/core/sched/utils.py): EOS, stop "
                                   "tokens, `max_tokens`, `max_model_len`; draft rollback.",
    "abort_relation": f"`Scheduler.finish_requests`, `_free_request` ({S}).",
    "reset_prefix_cache_relation": f"`Scheduler.reset_prefix_cache` ({S}), "
                                   f"`BlockPool.reset_prefix_cache` ({BP}).",
    "every_request_finishes": f"`Scheduler._update_waiting_for_remote_kv`, "
                              f"`_handle_blocked_waiting_request`, the `kv_holding_waiting` scan "
                              f"and the in-flight-prefill block reservation in `schedule` ({S}).",
    "transition_admitted_by_model": "every writer of `Request.num_computed_tokens`, `status`, "
                                    f"`num_preemptions` and `prefill_stats` in {S}: admission, "
                                    "async promotion, preemption, rollback, recovery.",
    "stats_are_ordered": f"`PrefillStats.set` (v1/metrics/stats.py) called from `Scheduler.schedule` "
                         f"({S}) with `num_new_local_computed_tokens` and the connector's "
                         "`num_external_computed_tokens`.",
    "stats_set_exactly_once": f"`Scheduler.schedule` ({S}): `PrefillStats.set` at every prefix "
                              "lookup of a never-preempted request until `take_prefill_stats` "
                              "(v1/request.py) hands them out with the first output.",
    "stats_are_the_first_hits": f"`Scheduler.schedule` ({S}): the local hit passed to "
                                "`get_num_new_matched_tokens` and the trims of the connector's "
                                "answer before `PrefillStats.set`.",
    "running_request_has_stats": f"`Scheduler.schedule` ({S}): `PrefillStats.set` before an "
                                 "admission to RUNNING or WAITING_FOR_REMOTE_KVS.",
    "unscheduled_request_has_no_output": f"`Scheduler._update_request_with_output` ({S}): "
                                         "outputs only for scheduled requests.",
    "cached_le_computed": f"`Scheduler.schedule` ({S}): `num_computed_tokens = local + external` "
                          "and the stats from the same numbers; recovery lowering "
                          "`num_computed_tokens` only.",
    "computed_within_tokens": f"`KVCacheManager.get_computed_blocks` ({KM}), the "
                              f"`num_new_tokens > 0` assert and the full-hit rule in "
                              f"`_update_waiting_for_remote_kv` ({S}).",
    "placeholders_nonnegative": "`AsyncScheduler._update_after_schedule`, "
                                "`_update_request_with_output` (v1/core/sched/async_scheduler.py; "
                                "in 0.33 the decrement is `Scheduler._update_request_with_output`"
                                f"); `Scheduler._preempt_request` ({S}).",
    "placeholders_match_in_flight": "`AsyncScheduler._update_after_schedule`, "
                                    "`_update_request_with_output` "
                                    "(v1/core/sched/async_scheduler.py; in 0.33 "
                                    "`Scheduler._update_request_with_output`); "
                                    f"`Scheduler._preempt_request`, `update_from_output` "
                                    f"(stale output), `_handle_invalid_blocks` ({S}).",
    "output_is_the_sampled_sequence": f"`Scheduler.update_from_output` ({S}): stale output "
                                      "of a preempted request (`num_stale_output_tokens`, "
                                      "`drop_stale_output`); `_update_request_with_output`.",
    "idle_waiting_holds_no_blocks": f"`Scheduler._preempt_request`, `_free_request_blocks`, "
                                    f"`_update_waiting_for_remote_kv` ({S}).",
    "preempted_means_preempted": f"`Scheduler._preempt_request`, `_handle_blocked_waiting_request` "
                                 f"({S}).",
    "blocks_cover_computed": f"`KVCacheManager.allocate_slots` ({KM}), "
                             "`SingleTypeKVCacheManager.allocate_new_blocks` and "
                             "`allocate_external_computed_blocks` "
                             "(v1/core/single_type_kv_cache_manager.py).",
    "every_group_serves_computed": "`SlidingWindowManager.remove_skipped_blocks` / "
                                   "`get_num_skipped_tokens`, `MambaManager`, "
                                   "`find_longest_cache_hit` (v1/core/single_type_kv_cache_manager"
                                   ".py); `HybridKVCacheCoordinator` (v1/core/kv_cache_coordinator"
                                   f".py); `_update_requests_with_invalid_blocks` ({S}).",
    "queues_match_status": f"`Scheduler._enqueue_waiting_request`, the skip and re-queue paths of "
                           f"`schedule`, `finish_requests` ({S}); `waiting`, `kv_holding_waiting`, "
                           "`running`.",
    "within_limits": f"`Scheduler.schedule` ({S}): `max_num_seqs` admission stop, the "
                     "`max_model_len` clip; `check_stop` (v1/core/sched/utils.py).",
    "ref_count_is_holders": f"`BlockPool.get_new_blocks`, `touch`, `free_blocks` ({BP}); "
                            "`KVCacheBlock.ref_cnt`.",
    "free_queue_is_free_blocks": f"`FreeKVCacheBlockQueue` (v1/core/kv_cache_utils.py) and its "
                                 f"callers in `BlockPool` ({BP}).",
    "no_leak_when_idle": f"`Scheduler._free_request`, `_free_blocks`, "
                         f"`_update_from_kv_xfer_finished` ({S}).",
    "finished_request_releases_blocks": f"`Scheduler._free_request` (delayed free), "
                                        f"`_update_from_kv_xfer_finished` ({S}): "
                                        "`finished_sending` and `finished_recving` of finished "
                                        "requests.",
    "prefix_cache_is_consistent": f"`BlockPool.cache_full_blocks`, `cache_partial_block` "
                                  f"(a partial block's entry), `_maybe_evict_cached_block` "
                                  f"({BP}); `cached_block_hash_to_block`.",
    "no_caching_of_invalid_blocks": f"`KVCacheManager.allocate_slots` caching at admission "
                                    f"({KM}); `Scheduler._update_waiting_for_remote_kv` and "
                                    f"`_handle_invalid_blocks` ({S}), which evicts failed "
                                    "blocks under the \"fail\" policy only: under "
                                    "\"recompute\" vLLM keeps them cached on purpose, to be "
                                    "recomputed and reused by requests sharing them (its "
                                    "comment there), and serves them before they are: "
                                    "kvspec's finding recompute-failed-block-stays-cached, "
                                    "which open PR #53298 addresses.",
    "computed_blocks_are_cached": f"`KVCacheManager.allocate_slots` and `cache_blocks` "
                                  f"({KM}): each group's manager caches its full blocks under "
                                  "its own group's key (`BlockPool.cache_full_blocks`).",
    "no_load_into_free_blocks": f"`Scheduler.finish_requests`, `_free_request` and "
                                f"`_update_from_kv_xfer_finished` ({S}): an aborted "
                                "WAITING_FOR_REMOTE_KVS request keeps its blocks until "
                                "`finished_recving` (`failed_recving_kv_req_ids`).",
    "computed_means_valid": f"`Scheduler._update_requests_with_invalid_blocks` ({S}) and every "
                            "writer of `num_computed_tokens`.",
    "send_source_intact": f"`Scheduler._free_request`, `_connector_finished` ({S}); "
                          "`KVConnectorBase_V1.request_finished` "
                          "(distributed/kv_transfer/kv_connector/v1/base.py).",
    "failed_block_recomputed_once": f"`Scheduler._update_requests_with_invalid_blocks` ({S}): "
                                    "`marked_invalid_block_ids` (local to one call: the async "
                                    "and the sync pass do not share it), the first running "
                                    "request to meet a failed block truncates there and owns "
                                    "the recompute; a request whose failed blocks were all "
                                    "marked by an earlier one is rolled back to the computed "
                                    "count it had before the step, failed block included, and "
                                    "scheduled as usual.",
    # the connector contract: what the scheduler relies on a connector to answer
    "lookup_answer_has_the_api_types": f"`Scheduler.schedule` ({S}): unpacks "
                                       "`ext_tokens, load_kv_async = "
                                       "self.connector.get_num_new_matched_tokens(...)` "
                                       "and compares `ext_tokens` with `None` and integers.",
    "finish_answer_has_the_api_types": f"`Scheduler._connector_finished` ({S}): unpacks "
                                       "`delay_free, kv_xfer_params = "
                                       "self.connector.request_finished(...)` (or "
                                       "`request_finished_all_groups(...)` for a connector "
                                       "declaring `SupportsHMA`), then ORs the delay with "
                                       "the partial-tail save's.",
    "meta_is_connector_metadata": f"`Scheduler.schedule` ({S}): "
                                  "`scheduler_output.kv_connector_metadata = "
                                  "connector.build_connector_meta(scheduler_output)`; the "
                                  "worker asserts it is not None "
                                  "(v1/worker/kv_connector_model_runner_mixin.py); "
                                  "MultiConnector's worker binds each child's part.",
    "report_names_finished_transfers": f"`Scheduler._update_from_kv_xfer_finished` ({S}): "
                                       "calls `self.connector.update_connector_output(...)`, "
                                       "then moves each `finished_recving` request on (assert "
                                       "it is waiting or finished) and frees each "
                                       "`finished_sending` one.",
    "async_load_has_tokens": f"`Scheduler.schedule` ({S}): an async answer parks the request "
                             "in WAITING_FOR_REMOTE_KVS after "
                             "`assert num_external_computed_tokens > 0`.",
    "hit_within_uncomputed_tokens": f"`Scheduler.schedule` ({S}): "
                                    "`get_num_new_matched_tokens` feeds `allocate_slots` "
                                    "(`num_new_computed_tokens + num_external_computed_tokens`) "
                                    "and the request's `num_computed_tokens`.",
    "sync_hit_leaves_a_token": f"`Scheduler.schedule` ({S}): a sync hit's tokens are counted "
                               "computed in the same step; `num_new_tokens` must stay positive.",
    "hit_with_last_state_leaves_last_token": "`MambaManager` (v1/core/single_type_kv_cache_manager"
                                             ".py, align mode): the state block of position "
                                             "`n - 1`; "
                                             "`NixlBaseConnectorScheduler._prefill_backoff` "
                                             "(nixl/base_scheduler.py).",
    "finished_load_not_offered_again": f"`Scheduler._update_waiting_for_remote_kv` ({S}): a "
                                       "landed load sends the request back to WAITING; "
                                       "`schedule` asks `get_num_new_matched_tokens` again only "
                                       "while `num_computed_tokens == 0` (a load that left "
                                       "nothing computed).",
    "hit_within_stored": "The connector's own lookup (`OffloadingManager.lookup`, "
                         "`ExampleConnector._found_match_for_prompt`); the scheduler trusts it.",
    "load_lands_in_given_blocks": f"`Scheduler.schedule` ({S}): `update_state_after_alloc("
                                  "request, self.kv_cache_manager.get_blocks(request_id), "
                                  "num_external_tokens)`, every block of the request, its "
                                  "local prefix-cache hit included (0.33 may defer the call to "
                                  "`_drain_deferred_loads` in `update_from_output`); the "
                                  "connector's metadata names the blocks its worker loads into. "
                                  "So the claim does not catch a load into the local hit's "
                                  "shared blocks.",
    "delay_covers_reads_in_flight": f"`Scheduler._free_request`, `_connector_finished` ({S}): "
                                    "`delay_free_blocks` keeps the blocks until "
                                    "`finished_sending`.",
    "store_reads_computed_kv": "The connector's `build_connector_meta` (what its worker saves "
                               f"in `save_kv_layer`) against `num_computed_tokens` after "
                               f"`_update_after_schedule` ({S}).",
    "load_reads_what_was_stored": "The connector's `build_connector_meta` (what its worker "
                                  "loads) against what its store holds; the scheduler counts "
                                  "the hit computed from `get_num_new_matched_tokens`.",
}
