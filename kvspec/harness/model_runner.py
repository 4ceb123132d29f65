"""The worker side the harness plays, as vLLM's model runner does: it keeps
the block tables the scheduler outputs tell it (``spec/worker.py``), runs
each step on them with the faults an action names, and samples. The KV is
the data oracle's alone (``kv="symbolic"``) or real tensors beside it
(``kv="torch"``: ``torch_worker.py``); both answer through this one class."""
from __future__ import annotations

from collections import Counter

import attrs

from kvspec.harness.env import EOS_TOKEN_ID, EnvConnector, draft_token, sampled_token
from kvspec.harness.kv_modes import KV_MODES
from kvspec.spec import history
from kvspec.spec.history import Ghost
from kvspec.spec.oracle import KVContent
from kvspec.spec.state import Config, Observation, RequestStatus, StepView, WorkerOutcome
from kvspec.spec.worker import apply_scheduler_output


def make_kv_worker(kv: str, config: Config, content: KVContent, plans: dict):
    """The worker's KV in real tensors (``kv="torch"``), or None: the data
    oracle alone. torch is imported only for "torch"."""
    if kv not in KV_MODES:
        raise ValueError(f"unknown KV mode {kv!r}: use {' or '.join(KV_MODES)}")
    if kv == "symbolic":
        return None
    from kvspec.harness.torch_worker import TorchWorker
    return TorchWorker(config, content, plans)


class ModelRunner:
    def __init__(self, config: Config, content: KVContent, env: EnvConnector, kv: str,
                 ghost: Ghost, features: Counter) -> None:
        self.content, self.env, self.ghost, self.features = content, env, ghost, features
        #: the torch worker, or None (the data oracle alone)
        self.kv = make_kv_worker(kv, config, content, env.plans)
        #: the block tables built from the scheduler outputs (spec/worker.py)
        self.tables: dict = {}

    def tell(self, step: StepView, mid: Observation) -> None:
        """The worker reads the scheduler output: its block tables move on."""
        self.tables = apply_scheduler_output(self.tables, step, mid.requests)

    def execute(self, step: StepView, mid: Observation, a: dict, pending=None):
        """Run a step, with the faults the action names, on the block tables
        the scheduler outputs told the worker (``get_told``)."""
        failing = set(a.get("fail", ()))
        if a.get("fail_all"):
            failing |= set(self.content.loads)
        told = self.get_told(step, mid)

        def run_oracle():
            return self.content.execute(step, told, set(a.get("finish_loads", ())), failing,
                                        a.get("fail_offset", 0), a.get("fail_blocks", 1),
                                        pending=pending, fail_group=a.get("fail_group", 0))
        if self.kv is None:
            return run_oracle()
        self.features["kv_torch"] += 1
        return self.kv.execute(step, told, pending or {}, run_oracle)

    def get_told(self, step: StepView, mid: Observation) -> Observation:
        """The state as the worker sees it: each scheduled request's block table
        as the scheduler outputs built it, as vLLM's model runner keeps it,
        where the worker keeps one: not for a last-state group, nor for a
        request a load failure cut back (the reference recomputes it in fresh
        blocks, which no output says). A scheduler that tells the worker
        something else has the KV written where it said."""
        if not self.tables:
            return mid
        groups, requests = mid.config.groups, dict(mid.requests)
        for rid in step.num_scheduled_tokens:
            r, told = requests.get(rid), self.tables.get(rid)
            if r is None or told is None or rid in self.ghost.recovered:
                continue
            tables = tuple(told[g] if g < len(told) and groups[g].kind != "last_state"
                           else table for g, table in enumerate(r.block_ids))
            requests[rid] = attrs.evolve(r, block_ids=tables)
        return attrs.evolve(mid, requests=requests)

    def take_violations(self, target) -> list:
        """The torch worker's findings since the last call: blocks whose
        tensors disagree with the oracle, requests that ended with tokens or
        logits other than the no-cache model's."""
        if self.kv is None:
            return []
        return self.kv.take_violations(target.observe(), target.final_view)

    def sample(self, step: StepView, mid: Observation, a: dict,
               pending: dict[str, tuple[int, ...]] | None = None) -> dict:
        """What the model samples for each request in this step: its accepted
        drafts and a bonus token (EOS where the environment says), each recorded
        at its position. ``pending``: tokens steps in flight sampled for it."""
        sampled = {}
        for rid, n in step.num_scheduled_tokens.items():
            r = mid.requests[rid]
            known = r.num_tokens + len((pending or {}).get(rid, ()))
            start = step.num_computed_before[rid]
            if start + n < known:
                continue  # a partial prefill chunk samples nothing
            drafts = step.scheduled_spec_decode_tokens.get(rid, ())
            position = start + n - len(drafts)
            sampled[rid] = self.get_sampled(rid, position, drafts, a)
            history.process_sampled(self.ghost, rid, position, sampled[rid])
        return sampled

    def get_sampled(self, rid: str, position: int, drafts, a: dict) -> tuple[int, ...]:
        """Its accepted drafts (real tensors: verified greedily; otherwise as many
        as the environment says) and a bonus token."""
        accept = (a.get("accept", 0) if self.kv is None
                  else self.kv.count_accepted(rid, position, drafts))
        accepted = []
        for token in drafts[:accept]:
            if token < 0:  # a padding slot (vLLM pads drafts with -1): never accepted
                break
            accepted.append(token)
        eos = rid in set(a.get("eos", ()))
        if self.kv is not None:
            bonus = self.kv.greedy_token(rid, position + len(accepted), eos)
        else:
            bonus = EOS_TOKEN_ID if eos else sampled_token(rid, position + len(accepted))
        return tuple(accepted + [bonus])

    def get_outcome(self, report, sampled: dict, a: dict, before: Observation) -> WorkerOutcome:
        """The worker's report of a step; its loads that landed are noted."""
        for rid in report.loaded_ok & set(before.requests):
            self.env.note_load_finished(rid, before.requests[rid].num_preemptions)
        return WorkerOutcome(
            sampled_token_ids=sampled,
            finished_recving=frozenset(report.finished_recving),
            finished_sending=frozenset(self.finish_sends(a)),
            invalid_block_ids=frozenset(report.invalid_block_ids))

    def finish_sends(self, a: dict) -> set[str]:
        done = set(a.get("finish_sends", ())) & set(self.content.sends)
        for rid in done:
            self.content.finish_send(rid)
        return done

    def note_output_applied(self, before: Observation, after: Observation, report,
                            outcome: WorkerOutcome) -> None:
        """What the environment learns once a step's output is applied."""
        for rid in after.running:
            r = after.requests[rid]
            if rid not in report.garbage_readers:  # an offloading store keeps real tokens
                self.env.note_computed(rid, r.num_computed_tokens - r.num_output_placeholders,
                                       r.num_tokens)
        history.process_output_applied(self.ghost, before, after, outcome.finished_recving)

    def is_kv_in_transfer(self, obs: Observation) -> bool:
        """KV of a transfer is held outside the running requests: a load under
        way, a loaded request not yet running, a send, or a request that ended
        and holds its blocks until the worker reports its transfer, or a
        real connector's pin on a block it transfers (its reset then fails
        with the same error vLLM gives for a load under way)."""
        return bool(self.content.loads) or bool(self.content.sends) or bool(
            obs.pool.pinned) or any(
            r.status != RequestStatus.RUNNING and any(r.block_ids or ())
            for r in obs.requests.values())

    def get_drafts(self, observe, num: int) -> dict[str, list[int]]:
        """The drafter's proposals for every decoding request (synchronous);
        ``observe``: the target's, called only when there are drafts to make."""
        if not num:
            return {}
        drafts, obs = {}, observe()
        for rid in obs.running:
            r = obs.requests[rid]
            if r.num_computed_tokens == r.num_tokens - 1:  # decoding
                drafts[rid] = [draft_token(rid, r.num_tokens + k, k) for k in range(num)]
        return drafts
