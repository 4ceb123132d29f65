"""Render docs/bug-zoo.md from bench/zoo_results.json (written by
`kvspec zoo --json > bench/zoo_results.json`)."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WHY = {
    "async_block_rounding": (
        "The rounded count claims tokens past the last external one. The data oracle sees "
        "it two ways: the block holding those positions is cached although its tail was never "
        "written (`no_caching_of_invalid_blocks`), and the request counts garbage as computed "
        "(`computed_means_valid`). Counters alone cannot see it: the numbers stay in range."),
    "stats_reset_on_reschedule": (
        "Only history shows a re-set: the ghost record of the first stats makes "
        "`stats_set_exactly_once` fire at the re-scheduling itself, before the pair goes out of "
        "order and the metrics counter goes negative (`stats_are_ordered`, #36533)."),
    "cache_failed_block": (
        "A block whose load failed stays in the prefix cache. This is the product promise "
        "'no caching of invalid blocks' verbatim; the oracle compares every cached block's "
        "content with what its hash names."),
    "preempt_keeps_blocks": (
        "A preempted request has nothing computed, so it must hold nothing: "
        "`idle_waiting_holds_no_blocks` states exactly that, and fires at the preemption."),
    "async_never_sets_stats": (
        "A RUNNING request without stats is the bug itself (`running_request_has_stats`); "
        "the Z3 strengthening `unscheduled_request_has_no_output` catches it too once tokens "
        "come out."),
    "async_caches_before_load": (
        "Blocks of an in-flight async load are pending: never readable, never cacheable. "
        "Caching them at allocation is visible at the end of the very step: cached content "
        "that is not yet there."),
    "sync_recovery_uses_cached_tokens": (
        "After a preemption the reload can cover more than the first scheduling's "
        "`num_cached_tokens` (an offloading store keeps what the request computed). A failure "
        "past that bound goes unnoticed and the request keeps garbage: the oracle sees the "
        "request finished on output computed from invalid KV (`update_from_output_relation`) "
        "or counting it (`computed_means_valid`). Needs preemption, offload and a failing "
        "reload together: the hardest mutant to reach by sampling. Flipping a coin per "
        "request for offload and sync loads, the fuzzer missed it within 60 s; with the "
        "run-level swarm shape (an offloading store for every request, all loads sync, "
        "frequent faults) it is found in seconds."),
    "shared_block_recomputed_by_none": (
        "The second holder of a failed shared block keeps it as computed and reads it before "
        "anyone recomputed it: `computed_means_valid` at the end of that step."),
    "shared_block_recomputed_by_all": (
        "Everyone holding the failed block recomputes it: two requests write the same slots "
        "in one step, which correct recovery never does (`failed_block_recomputed_once`)."),
    "truncate_past_first_invalid": (
        "Cutting after the invalid block instead of before it leaves that block counted: "
        "`computed_means_valid`; Z3 refutes the rule too."),
    "free_during_send": (
        "Freed blocks are reused and overwritten while the KV is still being sent: the oracle "
        "snapshots the sent blocks and `send_source_intact` fires when the next owner writes."),
    "length_capped_one_early": (
        "Planted (issue 9): a stop status must be earned. `update_from_output_relation` "
        "checks every request that ended, departed ones included (the target keeps their "
        "final view): LENGTH_CAPPED only at max_tokens outputs or max_model_len tokens."),
    "stopped_without_eos": (
        "Planted (issue 9): FINISHED_STOPPED only right after EOS; before the review the "
        "relation checked the stop only on requests still in the scheduler."),
    "abort_marks_stopped": (
        "Planted (issue 9): `abort_relation` now requires FINISHED_ABORTED of a live request, "
        "judged on its final view once it has left."),
    "finished_sending_ignored": (
        "Planted (issue 9): a finished request may hold blocks only while its send is pending "
        "(`finished_request_releases_blocks`), and a send reported finished frees them in the "
        "same call (`update_from_output_relation`); before, only `no_leak_when_idle` spoke, "
        "once every request was gone."),
    "async_load_counted_short": (
        "Planted (issue 9): counting an async load short is safe for the KV but drops what the "
        "connector delivered and misreports the hits. The Z3 model pins the count "
        "(`lemma_async_load_counts_delivered_tokens`), and `transition_admitted_by_model` holds "
        "the target to the model, so the short count is caught where it happens."),
    "placeholder_snapshot_before_increment": (
        "The count a scheduled step leaves behind lacks its own increment, so the real boundary "
        "`num_computed_tokens - num_output_placeholders` takes in the position the step is about "
        "to sample: a store or a cache working to it would treat a token nobody has sampled as "
        "known. `placeholders_match_in_flight` compares the count with what the steps in flight "
        "will sample and fires once the first sampling step is scheduled. The data oracle alone "
        "misses it: block hashes cover only known tokens and the environment's store never "
        "keeps more than the known tokens, so the extra position reaches no KV. With drafts "
        "`computed_within_tokens` would fire as well (Z3's "
        "`refute_placeholder_snapshot_before_increment`), but the async harness schedules none."),
    "preempt_keeps_placeholders": (
        "After the preemption the request has nothing computed yet still owns the placeholder "
        "of its dropped step: the real boundary is negative (`computed_within_tokens`, Z3's "
        "`refute_real_boundary_with_kept_placeholders`) and the count matches no step in flight "
        "(`placeholders_match_in_flight`), both at the preempting schedule. With the oracle "
        "alone the run goes on until the resumed request is scheduled past its tokens (the kept "
        "placeholder counts as a position to fill), and is caught there by the claim the "
        "table's oracle column names."),
    "stale_output_returns_share": (
        "The dropped frame takes its share off a count the preemption already set to 0: -1 at "
        "the delivery (`placeholders_nonnegative`). The negative count pushes the real boundary "
        "past what the request computed, so the oracle alone sees a position counted as "
        "computed that holds no KV (`computed_means_valid`)."),
    "stale_output_delivered": (
        "Late delivery is not wrong in itself: after a plain preemption the token was sampled "
        "from valid KV, vLLM 0.28+ delivers it, and `output_is_the_sampled_sequence` admits "
        "both. It is wrong after a recovery cut: the stale step ran on top of the failed block, "
        "and since the failing step's own token was discarded, its token lands one position "
        "early. The claim compares every output token with what the worker sampled at that "
        "position. The oracle alone does not read output tokens."),
    "free_under_step_in_flight": (
        "An aborted request's blocks go to the next request while its step is in flight; a "
        "load into them is not ordered with the compute stream, so when that step completes "
        "its writes land again over the loaded KV. The new owner counts KV that is not there "
        "(`computed_means_valid`) and caches it (`no_caching_of_invalid_blocks`); another "
        "shrink of it has recovery miss the freed table, leaving a block computed on a failed "
        "load cached. Fenced frees hold the blocks until the step's output is processed."),
    "preempt_past_fenced_victim": (
        "Under async scheduling almost every running request has a step in flight, so every "
        "victim's blocks are fenced: the retry preempts the whole running queue down to the "
        "request itself and frees nothing this step; next step all resume and the cycle "
        "repeats (the thrashing of vllm-ascend #16315). No safety claim sees it (each victim "
        "is the policy's, every count is right). The design rule "
        "`preemption_stops_at_fenced_victim` (vLLM's own since #49675: at most one fenced "
        "victim per schedule) sees the second fenced victim at once; before it, only the "
        "liveness claim `every_request_finishes` did, with a 56-row trace that carries the "
        "healed phase."),
    "stats_reset_by_dropped_first_output": (
        "A first output dropped as stale leaves the request without output, and the mutant "
        "takes that as 'stats not reported yet' and unsets them: `stats_set_exactly_once` "
        "fires at the drop (set, now unset), and `running_request_has_stats` when recovery cut "
        "the request back without preempting it (the shrunk trace); after a preemption the "
        "resumed request would record new values. Stats are invisible to the data oracle."),
    "rejection_keeps_placeholders": (
        "Spec decode under async scheduling: the placeholders a step reserves cover its drafts, "
        "so its rejected drafts must come off them with its output. The ghost count of "
        "`placeholders_match_in_flight` (the shares of the steps in flight) sees the excess at "
        "the first delivery that rejects a draft. The data oracle cannot: too many placeholders "
        "only hide real KV, they never expose missing KV."),
    "stale_rejection_rolls_back": (
        "The #46066 shape: a frame made stale by a preemption or a recovery cut still rolls "
        "back its rejected drafts, on a request that restarted and owns fresh placeholders. "
        "The count goes below the ghost's (`placeholders_match_in_flight`) and below zero "
        "(`placeholders_nonnegative`). The data oracle sees the computed count rolled back too "
        "only when it lands below a block boundary another request reads."),
    "draft_count_ignores_placeholders": (
        "Under async scheduling the positions past a request's tokens include the placeholders "
        "of its step in flight, so a step cut short (by the budget, the long-prefill cap or "
        "max_model_len) runs fewer drafts than were reserved. Counting from the tokens alone "
        "schedules every reserved draft for positions the step does not run: "
        "`schedule_relation` compares the drafts with the positions past the known tokens."),
    "hybrid_per_group_accounting": (
        "With several groups the single-group cut is not safe: a sliding-window group has given "
        "back the blocks behind its window, so the step from the cut reads null blocks there. "
        "`every_group_serves_computed` reads each group's table at the real computed count; "
        "Z3 refutes the same rule (`refute_recovery_cut_by_full_attention_alone`)."),
    "hybrid_single_group_unpack": (
        "The crash of #45474: any load failure on a hybrid config raises while unpacking the "
        "request's block ids as one group (`target_crashed`). vLLM 0.14 to 0.28 crash exactly "
        "so (docs/vllm-releases.md, hybrid column)."),
    "hybrid_hit_ignores_window": (
        "A hit the full-attention group serves but a sliding-window group no longer caches (its "
        "blocks behind the window were never cached, or were evicted): the window gets null "
        "blocks. The first step then reads garbage for the window's positions, and the data "
        "oracle sees its output cached and kept (`no_caching_of_invalid_blocks`, "
        "`update_from_output_relation`) when the table is not observed in between."),
    "hybrid_full_prompt_hit_window_freed": (
        "vLLM 0.32.0's own bug (finding hybrid-full-prompt-hit-window-freed): a hit of the whole "
        "prompt skips the window from the load's end, but the last token is recomputed one "
        "position earlier and its window starts one position earlier too: one block in "
        "`block_size` prompt lengths is null where it reads (`every_group_serves_computed`)."),
    "resumed_table_not_reset": (
        "The #26661 shape: a request resumed after a preemption goes out as a cached request "
        "whose new block ids the worker appends to the table it kept, instead of replacing it. "
        "The worker, reading what the scheduler sends as vLLM's model runner does, writes the "
        "resumed request's KV into blocks it no longer holds: `worker_tables_match_scheduler` "
        "compares the table the outputs built with the scheduler's, and the data claims see the "
        "KV land where the outputs said (issue 25, part 4)."),
    "hybrid_cache_under_plain_hash": (
        "Lost performance, not corruption: a multi-group request's blocks are cached under the "
        "plain block hash instead of the hash with its group, so no later lookup finds them "
        "and every prefix hit of a hybrid layout is recomputed. Every safety claim holds; the "
        "efficiency claim `computed_blocks_are_cached` names the computed block that is not "
        "cached under its key, and the run reports it apart as LOST PERFORMANCE (issue 25, "
        "part 6). With two block sizes it is corruption too: a window block and a "
        "full-attention block ending at the same position share the plain hash, and one is "
        "served as the other (`no_caching_of_invalid_blocks`)."),
    "hit_aligned_to_full_attention": (
        "With two block sizes a hit must end where every group's blocks end (the least "
        "common multiple of the sizes). Ended on a full-attention boundary inside a larger "
        "window block, the window group gets a fresh block there whose first positions "
        "nobody computed: the next step reads them (`computed_means_valid`), and the block "
        "is cached under a hash naming content it lacks (`no_caching_of_invalid_blocks`); the "
        "conformance relations see the count jump past what the hit can serve."),
}


def fmt(d, key):
    if d is None:
        return "-"
    if not d["caught"]:
        return "survived"
    value = d[key]
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def main() -> None:
    rows = json.loads((ROOT / "bench" / "zoo_results.json").read_text())
    caught = [r for r in rows if r["status"] == "caught"]
    times = [r["full"]["seconds"] for r in caught]
    lines = ["# The bug zoo", "",
             "<!-- Generated by `python bench/render_zoo.py` from bench/zoo_results.json "
             "(`kvspec zoo --json`). -->", "",
             "Each historical bug of this area, and each weak spot the first review of the spec "
             "found (planted, issue 9), put back into the reference implementation as "
             "a mutant (`kvspec targets` lists them as `mutant:<name>`). `kvspec zoo` fuzzes each "
             "with a budget and records who caught it; then again with only the data oracle's "
             "invariants enabled. Times are to the first failing example (detection); 'with "
             "shrink' adds Hypothesis' shrinking and the trace-level minimization; steps are "
             "rows of the minimized step table (healed-phase steps included). The traces are "
             "committed under `model_tests/regressions/` and replayed by the test suite. One "
             "run of `kvspec zoo --budget 60s --json` over every mutant on the 2-core "
             "development machine, shared with other work (times are upper bounds of a quiet "
             "machine's), after the environment began drawing what vLLM's own tests drive "
             "(connector roles, no connector, KV delivery, 3-4 steps in flight, 4 drafts) and "
             "the data oracle one state per Mamba block (issue 26). An "
             "efficiency mutant is caught when it loses performance with every safety claim "
             "holding (`computed_blocks_are_cached`).", "",
             f"Caught: {len(caught)} of {sum(r['status'] != 'pending' for r in rows)}; "
             f"median time to detection {statistics.median(times):.2f} s, "
             f"max {max(times):.2f} s." if times else "", "",
             "| mutant | upstream | expected | caught by | detect (s) | with shrink (s) | steps "
             "| oracle alone: caught by | detect (s) | steps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        full, alone = r.get("full"), r.get("oracle_alone")
        if r["status"] == "pending":
            lines.append(f"| {r['name']} | {r['upstream']} | - | pending (needs a spec "
                         f"feature not built yet) | | | | | | |")
            continue
        by = ", ".join(full["invariants"]) if full and full["caught"] else "survived"
        by_alone = ", ".join(alone["invariants"]) if alone and alone["caught"] else (
            "survived" if alone else "-")
        lines.append(f"| {r['name']} | {r['upstream']} | {r['expected']} | {by} | "
                     f"{fmt(full, 'seconds')} | {fmt(full, 'total_seconds')} | "
                     f"{fmt(full, 'steps')} | {by_alone} | {fmt(alone, 'seconds')} | "
                     f"{fmt(alone, 'steps')} |")
    prove = ROOT / "bench" / "prove_results.json"
    if prove.exists():
        bmc = json.loads(prove.read_text()).get("bmc", [])
        lines += ["", "## Bounded model checking", "",
                  "`kvspec bmc` (explicit-state, every sequence of up to 7 actions from an "
                  "8-action alphabet on a small configuration; see docs/proofs.md), from "
                  "bench/prove_results.json:", "",
                  "| target | found | actions | states | seconds |", "| --- | --- | --- | --- | --- |"]
        for row in bmc:
            found = ", ".join(row["found"]) if row["found"] else "nothing"
            lines.append(f"| {row['target']} | {found} | {row['trace_actions'] or '-'} | "
                         f"{row['states']} | {row['seconds']:.1f} |")
        lines += ["", "A mutant the fuzzer misses within its budget but BMC finds keeps the BMC "
                  "counterexample as its regression trace."]
    lines += ["", "## Why these invariants", ""]
    for r in rows:
        if r["name"] in WHY:
            lines += [f"### {r['name']}", "", r["description"] + ".", "", WHY[r["name"]], ""]
    (ROOT / "docs" / "bug-zoo.md").write_text("\n".join(lines) + "\n")
    print("wrote docs/bug-zoo.md")


if __name__ == "__main__":
    sys.exit(main())
