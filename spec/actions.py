"""Each action as a relation between the observed state before and after it.

Loose where a correct scheduler may choose (how much of a prefill it takes,
which equal-priority request goes first, whether to preempt), tight where
correctness lives (what ``num_computed_tokens`` may become, what tokens get
appended, what stays unchanged). Relations are registered beside the
invariants (kind "relation") so one registry lists every claim.
"""
from __future__ import annotations

from collections import Counter

import attrs

from kvspec.spec.arith import compute_computed_after_rejection
from kvspec.spec.predicates import is_first_cached_count
from kvspec.spec.registry import Witnessing, invariant
from kvspec.spec.state import Observation, RequestStatus, RequestView, StepView, WorkerOutcome
from kvspec.spec.worker import get_step_blocks


@attrs.define
class Transition(Witnessing):
    action: str
    before: Observation
    after: Observation
    step: StepView | None = None
    outcome: WorkerOutcome | None = None
    #: request id -> first invalid position it read in this step (data oracle)
    garbage_readers: dict[str, int] = attrs.Factory(dict)
    request_id: str | None = None
    #: requests that left the scheduler during the action, as they ended
    departed: dict[str, RequestView] = attrs.Factory(dict)
    #: request id -> the connector's answer (num_local, num_external) its stats came from
    first_hits: dict[str, tuple[int, int]] = attrs.Factory(dict)
    #: requests a load failure has cut back (they may resume over recomputed blocks)
    recovered: frozenset[str] = frozenset()
    #: for a schedule: the block tables the worker built from the scheduler
    #: outputs alone (spec/worker.py), after this one
    worker_tables: dict = attrs.Factory(dict)
    #: for an output: requests preempted since its step was scheduled (their
    #: output is stale; vLLM applies no rollback from it)
    stale: frozenset[str] = frozenset()
    #: requests that ended while their async load was in flight, the load not
    #: reported yet when the action began (they may hold their blocks for it)
    mid_load: frozenset[str] = frozenset()
    witnessed: int = 0

    def ended(self, rid: str) -> RequestView | None:
        """The request after the action, whether still known to the scheduler or gone."""
        return self.after.requests.get(rid) or self.departed.get(rid)


def _unchanged_fields(a, b) -> list[str]:
    fields = ("prompt_token_ids", "output_token_ids", "num_computed_tokens", "status",
              "num_cached_tokens", "num_external_computed_tokens", "block_ids")
    return [f for f in fields if getattr(a, f) != getattr(b, f)]


@invariant(cites="seed 004 (add_request)", kind="relation")
def add_relation(t: Transition):
    """add_request. Guard: a new id, a non-empty prompt that leaves room under
    ``max_model_len``, ``max_tokens >= 1``. Effect: the request is WAITING with
    nothing computed, no blocks and unset stats. Unchanged: every other request
    and the block pool."""
    if t.action != "add":
        return
    t.witness()
    r = t.after.requests.get(t.request_id)
    if r is None or r.status != RequestStatus.WAITING or r.request_id not in t.after.waiting:
        yield f"{t.request_id} is not WAITING in the waiting queue after add_request"
    elif r.num_computed_tokens or any(r.block_ids) or r.has_stats:
        yield f"{t.request_id} starts with computed tokens, blocks or stats"
    if t.after.pool != t.before.pool:
        yield "add_request changed the block pool"
    for rid, old in t.before.requests.items():
        new = t.after.requests.get(rid)
        if new is None or (new is not old and new != old and _unchanged_fields(old, new)):
            yield f"add_request changed request {rid}"


def get_prefill_cap(before: Observation) -> int:
    """vLLM's long-prefill cap for one step: the threshold when more than one
    request is eligible (running or waiting), none (0) otherwise; adaptive,
    never below a fair share of the token budget."""
    cfg = before.config
    eligible = len(before.running) + len(before.waiting)
    if eligible <= 1 or cfg.long_prefill_token_threshold <= 0:
        return 0
    if cfg.long_prefill_token_threshold_adaptive:
        return max(cfg.long_prefill_token_threshold, cfg.max_num_batched_tokens // eligible)
    return cfg.long_prefill_token_threshold


@invariant(cites="seed 004 (schedule: long_prefill_token_threshold)", kind="relation",
           role="design", action="schedule")
def long_prefill_cap(t: Transition):
    """With ``long_prefill_token_threshold`` set and more than one request
    eligible (running or waiting) when the step starts, no request is scheduled
    more tokens than the threshold in one step.

    A tuning rule of vLLM's default scheduler (vLLM 0.32 applies it to running
    and waiting requests alike and lifts it when only one request is eligible;
    the adaptive fair share is off by default), not a safety claim: it keeps a
    long prefill from starving the others. Witnessed by a request the cap cut
    short."""
    cap = get_prefill_cap(t.before)
    if cap <= 0:
        return
    for rid, n in t.step.num_scheduled_tokens.items():
        r = t.after.requests.get(rid)
        left = (r.num_tokens - t.step.num_computed_before.get(rid, 0)) if r else 0
        t.witness(n == cap and left > cap)  # the cap decided this chunk
        if n > cap:
            yield f"{rid}: {n} tokens scheduled > long-prefill cap {cap}"


def _check_admissions(t: Transition, step: StepView):
    """Requests that start running this step are reported to the worker as new
    or resumed; a resumed one has been preempted before."""
    admitted = set(step.new_req_ids) | set(step.resumed_req_ids)
    for rid in step.num_scheduled_tokens:
        if t.before.requests.get(rid) is None or t.before.requests[rid].status != RequestStatus.RUNNING:
            if rid not in admitted:
                yield f"{rid} started running but is reported neither new nor resumed"
    for rid in step.resumed_req_ids:
        r = t.after.requests.get(rid)
        if r is not None and r.num_preemptions < 1:
            yield f"{rid} reported resumed but was never preempted"
    for rid, start in step.num_computed_before.items():
        was, r = t.before.requests.get(rid), t.after.requests.get(rid)
        if was is not None and r is not None and not was.has_stats and r.has_stats:
            yield from _check_first_cached(t, r, start)
    for rid, r in t.after.requests.items():
        was = t.before.requests.get(rid)
        if (r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and r.has_stats
                and was is not None and not was.has_stats):  # recorded as the load is issued
            yield from _check_first_cached(t, r, r.num_computed_tokens)


def _check_first_cached(t: Transition, r, start: int):
    """Stats recorded at a first scheduling count the prefix it starts from; on
    a full-prompt hit the whole prompt may count (``is_first_cached_count``).
    After a load failure cut the prefix, the hits the load was issued for may be
    recorded instead (recovery may keep the stats: a scheduler's choice). Where
    the connector's answer was not heard, one starting at the last prompt token
    may count the whole prompt."""
    # the hits the scheduling started from: the connector's answer, unless the
    # scheduler did not use it (a released load recomputes from 0); unheard
    # (a watched scheduler's mocked connector), a full-prompt hit if it may be
    unheard = r.num_tokens if start == r.num_tokens - 1 else start
    local, external = t.first_hits.get(r.request_id, (unheard, 0))
    hits = local + external if min(local + external, r.num_tokens - 1) == start else start
    issued_for = r.request_id in t.recovered and is_first_cached_count(
        r.num_cached_tokens, local + external, r.num_tokens)
    if not is_first_cached_count(r.num_cached_tokens, hits, r.num_tokens) and not issued_for:
        yield (f"{r.request_id}: first scheduled at {start} computed, but "
               f"num_cached={r.num_cached_tokens}")


def _is_continuation(t: Transition, rid: str, start: int) -> bool:
    """A request running before the step starts where it stopped, or, cut back by
    a load failure, past it (resuming over blocks another request recomputed)."""
    old = t.before.requests.get(rid)
    if old is None or old.status != RequestStatus.RUNNING:
        return True
    computed = old.num_computed_tokens
    return start == computed or (start > computed and rid in t.recovered)


@invariant(cites="seed 004 (_preempt_request); scheduler.py schedule()", kind="relation",
           role="design", action="schedule")
def preemption_victim_follows_policy(t: Transition):
    """Preemption takes the victim the policy names: FCFS the tail of the running
    queue, PRIORITY never a request with a better (lower) priority value than one
    left running.

    A rule of vLLM's design, not a safety claim: which request gives way decides
    latency and fairness, and any victim keeps the KV correct. Witnessed by a
    step that preempted."""
    preempted = t.step.preempted_req_ids
    if not preempted:
        return
    t.witness()
    running = t.before.running
    if t.before.config.policy == "fcfs":
        if set(running[len(running) - len(preempted):]) != set(preempted):
            yield f"FCFS preempted {sorted(preempted)}, not the tail of running {list(running)}"
        return
    kept = [t.before.requests[r].priority for r in running if r not in preempted]
    for rid in preempted:
        if kept and t.before.requests[rid].priority < max(kept):
            yield f"PRIORITY preempted {rid} (priority {t.before.requests[rid].priority}) " \
                  f"while a request of priority {max(kept)} kept running"


@invariant(cites="#49674, #49675; vllm-ascend #16315", kind="relation", role="design",
           action="schedule")
def preemption_stops_at_fenced_victim(t: Transition):
    """A schedule preempts at most one request whose blocks are fenced (held
    back behind a step in flight, ``defer_block_free``).

    A rule of vLLM's design from 0.31 on (#49675), not a safety claim: such a
    victim frees nothing this step, so preempting on makes no room and only
    restarts more requests. Blocks are fenced when vLLM defers frees (a KV
    consumer connector with more than one batch in flight: async scheduling
    or pipeline parallelism); there nearly every victim is fenced, and the
    cascade of #49674 preempted the whole running queue every step, so
    requests never finished. vLLM 0.31 and later refuse a fenced
    victim outright; the reference preempts one and stops. Witnessed by a step
    that preempted."""
    if not t.step.preempted_req_ids:
        return
    t.witness()
    # a block the victim alone held tells whose free it is (a shared prefix
    # block is fenced by whichever holder's free came last)
    newly_fenced = Counter(t.after.pool.fenced) - Counter(t.before.pool.fenced)
    fenced = sorted(rid for rid in t.step.preempted_req_ids
                    if any(b in newly_fenced and t.before.pool.ref_cnt[b] == 1
                           for table in t.before.requests[rid].block_ids for b in table))
    if len(fenced) > 1:
        yield (f"preempted {len(fenced)} requests whose blocks are fenced ({', '.join(fenced)}): "
               "the first freed nothing, so the rest made no room")


def _get_known_tokens(t: Transition, rid: str) -> int:
    """Positions a step may schedule without drafts: the request's tokens, and
    under async scheduling the placeholder positions its steps in flight fill
    (a request the step preempted or admits has none in flight)."""
    was, r = t.before.requests.get(rid), t.after.requests[rid]
    held = was.num_output_placeholders if was is not None and \
        was.status == RequestStatus.RUNNING else 0
    return r.num_tokens + held


def get_last_position(cfg, r: RequestView) -> int:
    """How far a step may compute: ``max_model_len - 1``, leaving room for the
    token it samples; all of ``max_model_len`` for a request that samples none."""
    return cfg.max_model_len - (1 if r.samples_tokens else 0)


@invariant(cites="seed 004 (schedule); #27644", kind="relation")
def schedule_relation(t: Transition):
    """schedule. Effect: every scheduled request is RUNNING with at least one
    token scheduled, starting at its computed prefix and ending within its
    tokens (and, under async scheduling, the placeholder positions its steps
    in flight fill) plus scheduled drafts, below ``max_model_len - 1``
    (``max_model_len`` for a request that samples nothing); its scheduled
    drafts are exactly the
    positions past its known tokens; the total is within the token budget; a
    request that starts running is reported new or resumed (resumed only after a
    preemption); a preempted request has nothing computed and one more
    preemption; a request already running continues from its computed prefix
    (one a load failure cut back may resume past it, over blocks another request
    recomputed). Which request is preempted and how long a chunk may be are the
    design rules ``preemption_victim_follows_policy`` and ``long_prefill_cap``.
    Unchanged:
    tokens of every request, and ``num_computed_tokens`` of requests neither
    scheduled, preempted, moving through an external load, nor resuming after a
    load failure cut them back (over blocks another request recomputed)."""
    if t.action != "schedule":
        return
    step, cfg = t.step, t.after.config
    t.witness(len(step.num_scheduled_tokens))
    if step.total_num_scheduled_tokens > cfg.max_num_batched_tokens:
        yield f"{step.total_num_scheduled_tokens} tokens scheduled > budget {cfg.max_num_batched_tokens}"
    for rid, n in step.num_scheduled_tokens.items():
        r = t.after.requests.get(rid)
        start = step.num_computed_before.get(rid, -1)
        spec = len(step.scheduled_spec_decode_tokens.get(rid, ()))
        known = _get_known_tokens(t, rid)
        if r is None or r.status != RequestStatus.RUNNING or n < 1:
            yield f"{rid} scheduled with {n} tokens but is not RUNNING with work to do"
        elif start + n != r.num_computed_tokens:
            yield f"{rid}: computed {start} + scheduled {n} != num_computed {r.num_computed_tokens}"
        elif start < 0 or start + n > known + spec:
            yield f"{rid}: scheduled positions [{start}, {start + n}) past its {known}+{spec} tokens"
        elif start + n > get_last_position(cfg, r):
            yield f"{rid}: scheduled positions up to {start + n} past {get_last_position(cfg, r)}"
        elif spec != max(0, start + n - known):
            yield f"{rid}: {spec} drafts scheduled for {max(0, start + n - known)} positions past its tokens"
        elif not _is_continuation(t, rid, start):
            yield (f"{rid} was running with {t.before.requests[rid].num_computed_tokens} computed "
                   f"but was scheduled from {start}")
    yield from _check_admissions(t, step)
    for rid in step.preempted_req_ids:
        r = t.after.requests[rid]
        before = t.before.requests[rid]
        if r.num_preemptions != before.num_preemptions + 1 or \
                (r.status != RequestStatus.WAITING_FOR_REMOTE_KVS and r.num_computed_tokens):
            yield f"{rid} preempted but computed={r.num_computed_tokens} preemptions={r.num_preemptions}"
    for rid, old in t.before.requests.items():
        new = t.after.requests.get(rid)
        if new is None:
            yield f"{rid} disappeared during schedule"
        elif (old.prompt_token_ids, old.output_token_ids) != (new.prompt_token_ids,
                                                               new.output_token_ids):
            yield f"{rid}: schedule changed its tokens"
        elif (rid not in step.num_scheduled_tokens and rid not in step.preempted_req_ids
              and old.status == new.status == RequestStatus.RUNNING
              and old.num_computed_tokens < new.num_computed_tokens
              # a request a load failure cut back resumes over the blocks another
              # request recomputed as soon as it is ready, in a step whose budget or
              # pool may then leave it unscheduled (found by HypoFuzz, 2026-11-26)
              and rid not in t.recovered):
            yield f"{rid}: num_computed grew without being scheduled"


@invariant(cites="seed 004 (update_from_output), seed 003; #46240", kind="relation")
def update_from_output_relation(t: Transition):
    """update_from_output. Effect: a scheduled request appends a prefix of its
    sampled tokens (ending at the first stop) and loses exactly its rejected
    drafts from ``num_computed_tokens`` (``compute_computed_after_rejection``);
    it stops FINISHED_STOPPED right after a stop token (EOS or one of
    ``stop_token_ids``, from ``min_tokens`` outputs on; a request that samples
    nothing, once its prompt is computed) and only then, and
    FINISHED_LENGTH_CAPPED at ``max_tokens`` outputs or ``max_model_len`` tokens
    and only then; a request that read invalid KV in this step appends nothing
    and is not finished on that output (unless the "fail" policy ends it). Under
    ``kv_load_failure_policy`` "fail" every such request ends FINISHED_ERROR;
    under "recompute" none that held a block reported invalid does (other
    errors, a grammar that fails to compile, may end a request so). The late
    output of a request preempted since its step was scheduled (``stale``)
    rolls nothing back: its rejections predate the preemption's own rollback.
    A finished request whose send is reported in ``finished_sending`` gives its
    blocks back, unless its async load is still unreported: then its blocks
    wait for that report too (``no_load_into_free_blocks``). Unchanged: ``num_computed_tokens``
    never grows here. Requests that leave the scheduler during the call are
    judged as they ended."""
    if t.action != "update_from_output":
        return
    failed_by_policy = (t.outcome.invalid_block_ids
                        and t.after.config.kv_load_failure_policy == "fail")
    for rid, old in t.before.requests.items():
        new = t.ended(rid)
        if new is None:  # the target cannot show how the request ended
            continue
        added = new.output_token_ids[len(old.output_token_ids):]
        ended_now = new.status.is_finished and not old.status.is_finished
        t.witness(bool(added) or ended_now)
        if new.output_token_ids[:len(old.output_token_ids)] != old.output_token_ids:
            yield f"{rid}: output tokens were rewritten"
        elif added and rid in t.garbage_readers:
            yield (f"{rid} read invalid KV at token {t.garbage_readers[rid]} this step "
                   f"but its sampled tokens {list(added)} were kept")
        elif added and tuple(added) != t.outcome.sampled_token_ids.get(rid, ())[:len(added)]:
            yield f"{rid}: appended {list(added)}, sampled {t.outcome.sampled_token_ids.get(rid)}"
        elif ended_now and rid in t.garbage_readers and not failed_by_policy:
            yield (f"{rid} read invalid KV at token {t.garbage_readers[rid]} this step "
                   f"and was finished on that output")
        if new.num_computed_tokens > old.num_computed_tokens and not new.status.is_finished \
                and old.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            yield f"{rid}: num_computed grew in update_from_output"
        if added:
            yield from _check_stop(new, added)
        if ended_now:
            yield from _check_finish_status(new, t.after.config.max_model_len)
        yield from _check_failure_policy(t, rid, old, new)
        drafts = t.step.scheduled_spec_decode_tokens.get(rid, ()) if t.step else ()
        if added and drafts and rid not in t.garbage_readers and not new.status.is_finished \
                and rid not in t.stale:
            want = compute_computed_after_rejection(old.num_computed_tokens, len(drafts),
                                                    len(added) - 1)
            if new.num_computed_tokens != want:
                yield (f"{rid}: {len(drafts)} drafts, {len(added) - 1} accepted: num_computed "
                       f"should roll back to {want}, is {new.num_computed_tokens}")
    for rid in t.outcome.finished_sending:
        r = t.after.requests.get(rid)
        if is_load_unreported(t, rid):
            continue  # a load still writes its blocks: its report frees them
        if r is not None and r.status.is_finished and any(r.block_ids):
            yield f"{rid}: its send was reported finished but it still holds blocks {r.block_ids[0]}"


def is_load_unreported(t: Transition, rid: str) -> bool:
    """``rid`` ended mid-load and this output does not report its load either
    (a connector may report the send of a request before its load)."""
    return rid in t.mid_load and rid not in t.outcome.finished_recving


def _was_running(t: Transition, rid: str) -> bool:
    was = t.before.requests.get(rid)
    return was is not None and was.status == RequestStatus.RUNNING


def is_failed_holder(t: Transition, rid: str, old: RequestView) -> bool:
    """``rid`` read a failed load this step, or held a block reported invalid."""
    held = {b for table in old.block_ids for b in table}
    return rid in t.garbage_readers or bool(held & t.outcome.invalid_block_ids)


def _check_failure_policy(t: Transition, rid: str, old: RequestView, new):
    policy = t.after.config.kv_load_failure_policy
    errored = new.status == RequestStatus.FINISHED_ERROR and not old.status.is_finished
    if policy == "recompute" and errored and is_failed_holder(t, rid, old):
        yield f"{rid} ended FINISHED_ERROR under the 'recompute' policy"
    elif (policy == "fail" and rid in t.garbage_readers and not new.status.is_finished
          and _was_running(t, rid)):  # one preempted since its step ran recomputes anyway
        yield f"{rid} read a failed load under the 'fail' policy but is {new.status.name}"


def get_stop_ids(r) -> frozenset:
    """The tokens that end ``r``: EOS and its ``stop_token_ids``."""
    return frozenset(r.stop_token_ids) | ({r.eos_token_id} - {None})


def is_stop_at(r, index: int) -> bool:
    """Output ``index`` (0-based) is a stop token that must end ``r``: below
    ``min_tokens`` outputs a release may hold the stop back (vLLM 0.32 checks
    stop tokens first, the sampler masks them before ``min_tokens``)."""
    return r.output_token_ids[index] in get_stop_ids(r) and index + 1 >= r.min_tokens


def _check_stop(r, added):
    """The stop rules on the tokens just appended: a stop token (EOS or one of
    ``stop_token_ids``) ends the output and the request; so does reaching
    ``max_tokens``."""
    first = len(r.output_token_ids) - len(added)
    if any(is_stop_at(r, first + i) for i in range(len(added) - 1)):
        yield f"{r.request_id}: tokens appended after a stop token: {list(added)}"
    elif is_stop_at(r, len(r.output_token_ids) - 1) and r.status != RequestStatus.FINISHED_STOPPED:
        yield f"{r.request_id} sampled stop token {added[-1]} but is {r.status.name}"
    elif len(r.output_token_ids) > r.max_tokens:
        yield f"{r.request_id}: {len(r.output_token_ids)} outputs > max_tokens={r.max_tokens}"
    elif len(r.output_token_ids) == r.max_tokens and not r.status.is_finished:
        yield f"{r.request_id} reached max_tokens={r.max_tokens} but is {r.status.name}"


def is_stop_earned(r) -> bool:
    """FINISHED_STOPPED is earned by a stop token just sampled, or, for a
    request that samples nothing, by its prompt computed; with repetition
    detection on, by any output (vLLM's FINISHED_REPETITION reads as
    FINISHED_STOPPED, and the pattern it found is not modelled)."""
    if not r.samples_tokens:
        return not r.output_token_ids and r.num_computed_tokens >= r.num_prompt_tokens
    if r.detects_repetition and len(r.output_token_ids) >= max(1, r.min_tokens):
        return True  # vLLM checks for a pattern only from min_tokens outputs on
    return bool(r.output_token_ids) and r.output_token_ids[-1] in get_stop_ids(r)


def _check_finish_status(r, max_model_len: int):
    """A stop status is earned: FINISHED_STOPPED only right after a stop token
    (or with the prompt computed, for a request that samples nothing),
    FINISHED_LENGTH_CAPPED only at ``max_tokens`` outputs or ``max_model_len``
    tokens, FINISHED_ABORTED only by an abort."""
    outputs = r.output_token_ids
    if r.status == RequestStatus.FINISHED_STOPPED and not is_stop_earned(r):
        yield f"{r.request_id} ended FINISHED_STOPPED without a stop token (outputs {list(outputs)})"
    elif r.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(outputs) < r.max_tokens \
            and r.num_tokens < max_model_len:
        yield (f"{r.request_id} ended FINISHED_LENGTH_CAPPED with {len(outputs)} of "
               f"max_tokens={r.max_tokens} outputs")
    elif r.status == RequestStatus.FINISHED_ABORTED:
        yield f"{r.request_id} ended FINISHED_ABORTED without an abort"


@invariant(cites="seed 004 (finish_requests)", kind="relation")
def abort_relation(t: Transition):
    """abort. Effect: a live request ends FINISHED_ABORTED and is in no queue (one
    already finished keeps its status). Unchanged: every other request's tokens
    and computed count."""
    if t.action != "abort":
        return
    was, r = t.before.requests.get(t.request_id), t.ended(t.request_id)
    if was is not None and not was.status.is_finished:
        t.witness()
        if r is not None and r.status != RequestStatus.FINISHED_ABORTED:
            yield f"{t.request_id} is {r.status.name} after abort, not FINISHED_ABORTED"
    for rid, old in t.before.requests.items():
        new = t.after.requests.get(rid)
        if rid != t.request_id and new is not None and _unchanged_fields(old, new):
            yield f"abort of {t.request_id} changed {rid}"


def is_preempted_view(r: RequestView) -> bool:
    """Preempted with nothing kept: no computed tokens, no blocks."""
    return (r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
            and not any(r.block_ids or ()))


@invariant(cites="seed 004 (reset_prefix_cache)", kind="relation")
def reset_prefix_cache_relation(t: Transition):
    """reset_prefix_cache. Guard: none. Effect: when it reports success the
    prefix cache is empty; forced (``reset_running_requests``, as after a
    weight update), every running request is first preempted (PREEMPTED,
    nothing computed, no blocks; its output in flight is stale, #46066,
    #49860). A forced reset may refuse (report failure) only having changed
    nothing: no request preempted, the cache as it was. vLLM as released
    preempts everything and then raises when any block is still held (a
    step in flight fencing the preempted requests' blocks, a load in flight,
    a delayed-free send); the fix in the packet
    forced-reset-raises-under-deferred-frees refuses before preempting, and
    its callers retry once no step is in flight. Unchanged: every other
    request."""
    if t.action != "reset_prefix_cache":
        return
    forced, ok = t.request_id.startswith("forced:"), t.request_id.endswith("True")
    refused = forced and not ok
    t.witness(ok)
    if ok and t.after.pool.cached:
        yield "reset_prefix_cache reported success but the cache is not empty"
    if refused and t.after.pool.cached != t.before.pool.cached:
        yield "a forced reset_prefix_cache reported failure after changing the prefix cache"
    for rid, old in t.before.requests.items():
        new = t.after.requests.get(rid)
        if new is None:
            yield f"reset_prefix_cache removed {rid}"
        elif forced and not refused and old.status == RequestStatus.RUNNING:
            if not is_preempted_view(new):
                yield (f"forced reset_prefix_cache left {rid} {new.status.name} with "
                       f"num_computed={new.num_computed_tokens}, blocks={new.block_ids}")
        elif _unchanged_fields(old, new):
            yield (f"a forced reset_prefix_cache reported failure after changing {rid}"
                   if refused else f"reset_prefix_cache changed {rid}")


@invariant(cites="#26661, #26385", kind="relation", action="schedule")
def worker_tables_match_scheduler(t: Transition):
    """Where a scheduled step reads or writes, the block table the worker built
    from the scheduler outputs alone (``spec/worker.py``: a new request's whole
    table, a resumed one's replacing the old, the blocks allocated since for
    the rest) holds the scheduler's own block, in every full-attention and
    sliding-window group (a last-state group's table is not compared).

    Protects the model runner from computing on KV it was not given: a resumed
    request whose table the worker did not reset reads its old blocks or
    overflows its table (#26661), and an output that leaves out or repeats an
    allocation makes the worker write into another request's block. Witnessed
    by every scheduled request of a target that sends block ids. Not compared:
    a request a load failure cut back (the reference recomputes it in fresh
    blocks while it runs, which vLLM's output has no way to say)."""
    if t.step is None or not t.step.new_block_ids:
        return
    for rid, num_new in t.step.num_scheduled_tokens.items():
        r = t.after.requests.get(rid)
        if r is None or rid in t.recovered:
            continue
        t.witness()
        found = _first_table_difference(t, r, t.worker_tables.get(rid, ()), num_new)
        if found:
            yield f"{rid}: {found}"


def _is_same_run(mine: tuple, theirs: tuple, lo: int, hi: int) -> bool:
    """Both tables hold the same blocks at every index in ``[lo, hi)``."""
    return hi <= len(mine) and hi <= len(theirs) and mine[lo:hi] == theirs[lo:hi]


def _first_table_difference(t: Transition, r: RequestView, worker, num_new: int) -> str:
    start = t.step.num_computed_before[r.request_id]
    for g, group in enumerate(t.after.config.groups):
        if group.kind == "last_state":
            continue
        mine = r.block_ids[g] if g < len(r.block_ids) else ()
        theirs = worker[g] if g < len(worker) else ()
        indices = get_step_blocks(group, start, num_new)
        if indices and _is_same_run(mine, theirs, indices[0], indices[-1] + 1):
            continue
        for i in indices:
            want = mine[i] if i < len(mine) else None
            got = theirs[i] if i < len(theirs) else None
            if got != want:
                return (f"group {g} block index {i}: the worker's table (from the scheduler "
                        f"outputs) holds {got}, the scheduler's {want}")
    return ""
