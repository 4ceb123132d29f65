"""The Hypothesis state machine: the environment picks every action, the
runner drives the target and checks the spec after every call.

One run is a safety phase (arrivals, faults, aborts, resets) followed, in
teardown, by a healed phase (``drain``) in which every request must finish.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from typing import Callable

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvspec.harness.interrupt import is_interrupted, stop_if_interrupted
from kvspec.harness.profiles import MODELLED, EnvProfile
from kvspec.harness.runner import ALL_KINDS, BudgetSpent, Counterexample, Runner
from kvspec.harness.target import make_config
from kvspec.harness.trace import is_well_within_limits
from kvspec.spec.state import BATCH_QUEUE_DEPTH, MAX_DRAFTS, SYNC_MAX_DRAFTS, GroupSpec

#: shared prefixes so that prefix caching and shared blocks matter
PREFIXES = ((1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5), (2, 4, 6, 1, 3, 5, 7, 2, 4, 6, 1, 3),
            (7, 7, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5))
MAX_REQUESTS = 8
#: the run sizes ``fuzz`` and ``check`` draw (``--scale``): "small" (the rules'
#: draws as they are), "production" (every run production-sized,
#: ``ProductionMachine``), "mixed" (one batch in ``PRODUCTION_EVERY`` is)
SCALES = ("small", "mixed", "production")
#: what ``kvspec check`` and ``fuzz`` run by default; ``--scale`` sets it for a
#: whole campaign, its workers included
DEFAULT_SCALE = "mixed"
SCALE_ENV = "KVSPEC_SCALE"


def get_scale() -> str:
    """The run sizes this process's campaigns draw (``SCALE_ENV``)."""
    raw = os.environ.get(SCALE_ENV, "").strip() or DEFAULT_SCALE
    if raw not in SCALES:
        raise ValueError(f"{SCALE_ENV}={raw!r}: one of {', '.join(SCALES)}")
    return raw

# Faults and events name requests by index; most counterexamples involve the
# first few requests, so draw from those (a larger range rarely hits a live one).
ids = st.sets(st.integers(0, 3), max_size=2)


@attrs.frozen
class Swarm:
    """Run-level shape of the environment, drawn once per run (swarm testing,
    Groce et al., ISSTA 2012): a run that turns some behaviour on for every
    request, or off for all, reaches compound states (an offloading store, a
    preemption, a reload that fails) far more often than one that flips an
    independent coin for each request. Hypothesis already swarms the rules."""

    #: "offloading": every request's store keeps what it computes (LMCache-like);
    #: "plain": none does; "mixed": each request draws
    store: str = "mixed"
    #: "sync" / "async": every load runs that way; "mixed": each request draws
    loads: str = "mixed"
    #: out of 4: the odds that a step fails every load in flight
    fault_odds: int = 1

    def offload(self, drawn: bool) -> bool:
        return {"offloading": True, "plain": False}.get(self.store, drawn)

    def load_async(self, drawn: bool) -> bool:
        return {"sync": False, "async": True}.get(self.loads, drawn)


swarms = st.builds(Swarm, store=st.sampled_from(["mixed", "offloading", "plain"]),
                   loads=st.sampled_from(["mixed", "sync", "async"]),
                   fault_odds=st.sampled_from([1, 1, 2, 3]))


#: KV cache group layouts: what current models have (Llama: one full-attention
#: group; Gemma 3 / gpt-oss: full attention and sliding window; Jamba / Qwen3-Next:
#: full attention and a last-state group; and all three kinds together).
#: "sliding-mixed": full attention and a sliding window whose blocks hold
#: different numbers of tokens (one twice the other), as vLLM gives them when
#: it equalises their pages (a float32 window beside float16 attention)
LAYOUTS = {"full": (), "sliding": ("sliding_window",), "state": ("last_state",),
           "sliding+state": ("sliding_window", "last_state"),
           "sliding-mixed": ("sliding_window",)}
#: the layouts whose groups differ in block size
MIXED_SIZES = ("sliding-mixed",)


def make_groups(layout: str, block_size: int, window: int,
                larger: str = "full_attention") -> tuple[GroupSpec, ...]:
    """The layout's groups of ``block_size``; in a mixed layout the ``larger``
    kind's blocks hold twice as many tokens."""
    def size(kind: str) -> int:
        return block_size * 2 if layout in MIXED_SIZES and kind == larger else block_size
    return (GroupSpec(size("full_attention")),) + tuple(
        GroupSpec(size(kind), kind, window if kind == "sliding_window" else 0)
        for kind in LAYOUTS[layout])


def make_prompt(index: int, prefix: int, prefix_len: int, suffix_len: int) -> list[int]:
    return list(PREFIXES[prefix][:prefix_len]) + [10 + index * 7 + k for k in range(suffix_len)]


#: what each run's configuration is drawn from (``_size`` scales it)
CONFIG_DRAWS = dict(
    block_size=st.sampled_from([2, 3, 4]), spare_blocks=st.integers(1, 12),
    budget=st.integers(4, 24), max_num_seqs=st.integers(1, 4),
    max_model_len=st.integers(12, 24), threshold=st.sampled_from([0, 0, 1, 3, 5]),
    policy=st.sampled_from(["fcfs", "priority"]),
    failure_policy=st.sampled_from(["recompute", "recompute", "fail"]),
    swarm=swarms, scheduling=st.sampled_from(["async", "async", "sync"]),
    kv_role=st.sampled_from(["kv_both", "kv_both", "kv_consumer", "kv_producer"]),
    # "best_effort": the connector does not require KV delivery (the
    # offloading connectors); "none": no connector at all
    connector=st.sampled_from(["default", "default", "best_effort", "none"]),
    # steps in flight: 2, or a pipeline's depth
    batches=st.sampled_from([2, 2, 3, 4]),
    async_drafts=st.sampled_from([0, 2, MAX_DRAFTS]),
    # one group half the time: most claims are about the scheduler, not the groups
    layout=st.sampled_from(["full"] * (len(LAYOUTS) - 1) + sorted(set(LAYOUTS) - {"full"})),
    window=st.integers(1, 9),
    # a mixed layout: whose blocks are the larger
    larger=st.sampled_from(["full_attention", "sliding_window"]))


class KVSpecMachine(RuleBasedStateMachine):
    target_name = "impl"
    kinds = ALL_KINDS
    profile: EnvProfile = MODELLED
    design_rules: bool = True
    kv: str = "symbolic"  # the worker's KV: symbolic, or torch (real tensors)
    #: called with the failing runner before anything else happens (save first);
    #: returns True when a known finding explains it: the run then ends quietly
    #: (Hypothesis sees a pass) and fuzzing goes on
    on_counterexample: Callable[[Counterexample], bool | None] | None = None
    #: time.monotonic() past which every action is skipped: the budget bounds
    #: shrinking too (a shrink candidate then passes, and shrinking stops)
    deadline: float | None = None
    stats: Counter = Counter()
    #: how big a run is ("small" or "production"): counted per run
    scale: str = "small"
    #: requests one run may add
    max_requests: int = MAX_REQUESTS

    def __init__(self) -> None:
        super().__init__()
        self.runner: Runner | None = None
        self.next_index = 0
        self.failed = False
        #: the run ended early: a known finding explained it, or the budget is spent
        self.dead = False
        self.swarm = Swarm()
        type(self).stats["runs"] += 1
        type(self).stats[f"scale:{self.scale}"] += 1

    def _apply(self, action: dict) -> None:
        stop_if_interrupted()
        if self.dead or (self.deadline is not None and time.monotonic() > self.deadline):
            self.dead = True
            return
        try:
            self.runner.apply(action)
        except BudgetSpent:  # inside a drain: no verdict, the run ends
            self.dead = True
            return
        except Counterexample as exc:
            self.failed = True
            if self.on_counterexample is not None and type(self).on_counterexample(exc):
                self.dead = True
                type(self).stats["explained"] += 1
                return
            raise
        finally:
            type(self).stats["actions"] += 1

    def _ext(self, ext: int, prompt: list[int]) -> int:
        if not self.runner.config.is_kv_consumer:
            return 0  # a producer's connector only stores
        return max(0, min(ext, len(prompt)))

    def _ids(self, indices) -> list[str]:
        return [f"r{i}" for i in sorted(indices) if i < self.next_index]

    def _pick(self, drawn) -> list[str]:
        """The requests a step's drawn indices name (faults, EOS, sends)."""
        return self._ids(drawn)

    @initialize(**CONFIG_DRAWS)
    def configure(self, block_size, spare_blocks, budget, max_num_seqs, max_model_len,
                  threshold, policy, failure_policy, swarm, scheduling, kv_role, async_drafts,
                  layout="full", window=1, connector="default", batches=2,
                  larger="full_attention"):
        self.swarm = swarm
        block_size, spare_blocks, budget, max_num_seqs, max_model_len, threshold, window = \
            self._size(block_size, spare_blocks, budget, max_num_seqs, max_model_len,
                       threshold, window)
        layout = self._drawable(layout)
        groups = make_groups(layout, block_size, window, larger)
        if scheduling not in self.profile.scheduling:
            scheduling = self.profile.scheduling[0]
        if not self._may_draft(groups) or scheduling != "async" \
                or not self.profile.async_spec_decode:
            async_drafts = 0
        # The token budget fits a decode step with every draft: vLLM pads a new
        # decode request to 1 + num_speculative_tokens rows and will not schedule
        # it un-padded, so a smaller budget (which no deployment runs) never would.
        budget = max(budget, 1 + async_drafts)
        if policy not in self.profile.policies:
            policy = self.profile.policies[0]
        if failure_policy not in self.profile.failure_policies:
            failure_policy = self.profile.failure_policies[0]
        if 0 < threshold < self.profile.min_prefill_threshold:
            threshold = self.profile.min_prefill_threshold
        # The pool always fits one request of max_model_len in every group, as
        # vLLM checks at start-up.
        spare_blocks = max(spare_blocks, self.profile.min_spare_blocks)
        num_blocks = sum(-(-max_model_len // g.block_size) for g in groups) + spare_blocks
        kv_role = kv_role if kv_role in self.profile.kv_roles else self.profile.kv_roles[0]
        connector = connector if connector in self.profile.connectors else \
            self.profile.connectors[0]
        config = make_config(block_size=block_size, num_blocks=num_blocks,
                             max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, long_prefill_token_threshold=threshold,
                             policy=policy, kv_load_failure_policy=failure_policy,
                             async_scheduling=scheduling == "async",
                             kv_role=kv_role, kv_connector=connector != "none",
                             **({"requires_kv_delivery": False}
                                if connector == "best_effort" else {}),
                             max_concurrent_batches=batches if scheduling == "async"
                             else BATCH_QUEUE_DEPTH,
                             # spec decode under async: drafts the worker fills
                             num_speculative_tokens=async_drafts, groups=groups)
        self.runner = Runner(self.target_name, config, self.kinds, self.design_rules, kv=self.kv)
        self.runner.deadline = self.deadline

    def _size(self, *drawn: int) -> tuple[int, ...]:
        """block_size, spare_blocks, budget, max_num_seqs, max_model_len,
        threshold and window, as this run's scale makes them of the draws."""
        return drawn

    def _drawable(self, layout: str) -> str:
        """The layout drawn, or, where the profile leaves it out, the one it
        allows that is nearest: hybrid for hybrid (so a target that maps fewer
        group kinds still runs several groups half the time)."""
        allowed = self.profile.layouts
        if layout in allowed:
            return layout
        hybrid = [x for x in allowed if x != "full"]
        return hybrid[0] if layout != "full" and hybrid else allowed[0]

    def _may_fail(self, rid: str) -> bool:
        """The environment may fail this request's loads (with several groups,
        only where the profile's release can be told of the failure)."""
        allowed = self.profile.load_failures_with_groups
        if len(self.runner.config.groups) == 1 or allowed == "any":
            return True
        plan = self.runner.env.plans.get(rid)
        return allowed == "async" and plan is not None and plan.load_async

    @precondition(lambda self: self.next_index < self.max_requests)
    @rule(prefix=st.integers(0, 2), prefix_len=st.integers(0, 12), suffix_len=st.integers(1, 6),
          max_tokens=st.integers(1, 6), priority=st.integers(0, 2), ext=st.integers(0, 18),
          load_async=st.booleans(), none=st.integers(0, 2), send=st.booleans(),
          offload=st.booleans(), pd=st.booleans())
    def add_request(self, prefix, prefix_len, suffix_len, max_tokens, priority, ext,
                    load_async, none, send, offload, pd=False):
        config = self.runner.config
        prompt = make_prompt(self.next_index, prefix, prefix_len, suffix_len)
        prompt = prompt[:config.max_model_len - 1]
        load_async = self.swarm.load_async(load_async)
        pd = pd and config.kv_role != "kv_both" and config.kv_connector
        if pd and config.is_kv_consumer:  # do_remote_prefill: the whole prompt, async
            ext, load_async, none = len(prompt), True, 0
        if pd and config.is_kv_producer:  # do_remote_decode: a prefill node's one token
            send, max_tokens = True, 1
        action = {"op": "add", "id": f"r{self.next_index}", "prompt": prompt,
                  "max_tokens": max_tokens, "priority": priority, "ext": self._ext(ext, prompt),
                  "async": load_async, "none": none,
                  "send": send and config.is_kv_producer
                  and (self.profile.async_load_with_send or not load_async),
                  "offload": self.swarm.offload(offload) and config.is_kv_consumer,
                  **({"pd": True} if pd else {})}
        self.next_index += 1
        self._apply(action)

    @precondition(lambda self: self.next_index < self.max_requests - 1)
    @rule(prefix=st.integers(0, 2), prefix_len=st.integers(4, 12), count=st.integers(2, 3),
          ext=st.integers(2, 12), load_async=st.booleans())
    def add_burst(self, prefix, prefix_len, count, ext, load_async):
        """Requests sharing a system prompt arrive together; the first finds its
        prefix in the external store, the others hit what it brings in."""
        for k in range(min(count, self.max_requests - self.next_index)):
            prompt = make_prompt(self.next_index, prefix, prefix_len, 1 + k)
            prompt = prompt[:self.runner.config.max_model_len - 1]
            first = k == 0
            action = {"op": "add", "id": f"r{self.next_index}", "prompt": prompt, "max_tokens": 2,
                      "ext": self._ext(ext, prompt) if first else 0,
                      "async": self.swarm.load_async(load_async) and first,
                      "offload": self.swarm.offload(False)
                      and self.runner.config.is_kv_consumer}
            self.next_index += 1
            self._apply(action)

    @rule(finish_loads=ids, fail=ids, fail_roll=st.integers(0, 3),
          fail_offset=st.integers(0, 3), fail_blocks=st.integers(1, 4), eos=ids,
          finish_sends=ids, accept=st.integers(0, MAX_DRAFTS + 1),
          drafts=st.integers(0, MAX_DRAFTS),
          fail_group=st.integers(0, 2))
    def step(self, finish_loads, fail, fail_roll, fail_offset, fail_blocks, eos, finish_sends,
             accept, drafts, fail_group=0):
        fail_all = fail_roll >= 4 - self.swarm.fault_odds
        if not self.profile.load_failures:
            fail, fail_all = set(), False
        failing = [rid for rid in self._pick(fail) if self._may_fail(rid)]
        everyone = self._ids(range(self.next_index))
        if fail_all and not all(self._may_fail(rid) for rid in everyone):
            # only some loads may fail: name them (a trace replays what it names)
            failing, fail_all = [rid for rid in everyone if self._may_fail(rid)], False
        self._apply({"op": "step", "finish_loads": self._pick(finish_loads),
                     "fail": failing, "fail_all": fail_all,
                     "fail_offset": fail_offset,
                     **({"fail_blocks": fail_blocks} if fail_blocks > 1 else {}),
                     **({"fail_group": fail_group % len(self.runner.config.groups)}
                        if len(self.runner.config.groups) > 1 else {}),
                     "eos": self._pick(eos),
                     "finish_sends": self._pick(finish_sends), "accept": accept,
                     "drafts": self._drafts(drafts)})

    def _drafts(self, drawn: int) -> int:
        """Drafts the worker proposes this step: none beside a last-state group;
        synchronous, at most ``SYNC_MAX_DRAFTS`` (what the vLLM target configures);
        async, the placeholders it fills (at most ``num_speculative_tokens``)."""
        config = self.runner.config
        if not self._may_draft(config.groups):
            return 0
        return drawn if config.async_scheduling else min(drawn, SYNC_MAX_DRAFTS)

    def _may_draft(self, groups) -> bool:
        """Drafts (sync, or async placeholders) are drawn with these groups."""
        return (self.profile.spec_decode_with_last_state
                or all(g.kind != "last_state" for g in groups))

    @precondition(lambda self: self.next_index > 0)
    @rule(index=st.integers(0, MAX_REQUESTS - 1))
    def abort(self, index):
        for rid in self._pick([index]):
            self._apply({"op": "abort", "id": rid})

    @rule(running=st.sampled_from([False, False, True]))
    def reset_prefix_cache(self, running):
        """``running``: forced, preempting every running request first (what a
        weight update or ``/reset_prefix_cache?reset_running_requests=true`` does)."""
        # vLLM does not support a forced reset while KV is in transfer (its error
        # says so): the environment does not ask for one then
        running = running and not self.runner.model_runner.is_kv_in_transfer(self.runner.obs)
        self._apply({"op": "reset_prefix_cache", **({"running": True} if running else {})})

    def teardown(self):
        # an interrupt may have left a step half applied: nothing more is judged
        if self.runner is not None and not self.failed and not is_interrupted():
            self._apply({"op": "drain"})
            for lost in self.runner.lost:  # efficiency: reported, never a failure
                if self.on_counterexample is not None:
                    type(self).on_counterexample(lost)
        if self.runner is not None:
            r, stats = self.runner, type(self).stats
            stats.update({f"check:{k}": v for k, v in r.checks.items()})
            stats.update({f"witness:{k}": v for k, v in r.witnessed.items()})
            stats.update({f"feature:{k}": v for k, v in r.features.items()})
            inc = r.checker.incremental  # how many checks judged what changed, how many all
            stats.update({"state_checks:incremental": inc.checks - inc.full_checks,
                          "state_checks:full": inc.full_checks})


#: production-sized runs (issue 30): long shared prefixes for the waves' prompts
LONG_PREFIXES = tuple(tuple(1 + (p * 7919 + k * 104_729) % 997 for k in range(3000))
                      for p in range(3))
#: the longest prompt a wave adds (vLLM's tests use 1,600-token prompts; production
#: prompts run to thousands)
MAX_WAVE_PROMPT = 4000
#: the production model's context: every wave prompt and its outputs fit
PRODUCTION_MODEL_LEN = 4096
#: vLLM's default block size
PRODUCTION_BLOCK_SIZE = 16


#: what a wave of long requests is drawn from
WAVE_DRAWS = dict(prefix=st.integers(0, 2), count=st.integers(16, 64),
                  prefix_len=st.integers(500, 3000), suffix_len=st.integers(500, 1000),
                  max_tokens=st.integers(1, 32), ext=st.integers(0, MAX_WAVE_PROMPT),
                  load_async=st.booleans(), send=st.booleans(), offload=st.booleans(),
                  priority=st.integers(0, 2))


class ProductionMachine(KVSpecMachine):
    """Runs at production size, so that bugs that need size show: vLLM's block
    size, a pool of about 1,000 to 10,000 blocks, a 1,024 to 8,192-token budget,
    64 to 256 concurrent requests, a 4,096-token context, and waves of 16 to 64
    requests whose prompts of 1,000 to 4,000 tokens share long prefixes. The
    same draws as a small run, scaled (``_size``), so a failure shrinks the same
    way; the small rules stay (short requests beside the long ones)."""

    scale = "production"
    max_requests = 256

    def _size(self, block_size, spare_blocks, budget, max_num_seqs, max_model_len,
              threshold, window):
        return (PRODUCTION_BLOCK_SIZE, spare_blocks * 800, 1024 * max(1, budget // 3),
                64 * max_num_seqs, PRODUCTION_MODEL_LEN, threshold * 256, window * 128)

    def _pick(self, drawn) -> list[str]:
        """The drawn indices (0 to 7) spread over the run's requests, so that
        faults, EOS and aborts reach the long requests of every wave."""
        stride = max(1, self.next_index // 8)
        return self._ids({i * stride for i in drawn})

    @initialize(**CONFIG_DRAWS, first_wave=st.fixed_dictionaries(WAVE_DRAWS))
    def configure(self, first_wave, **drawn):
        """A production run begins with a wave: every run is large, whatever the
        rules draw after it."""
        super().configure(**drawn)
        self.add_wave(**first_wave)

    @precondition(lambda self: self.next_index < self.max_requests)
    @rule(**WAVE_DRAWS)
    def add_wave(self, prefix, count, prefix_len, suffix_len, max_tokens, ext, load_async,
                 send, offload, priority=0):
        """Many long requests arrive together sharing a system prompt; each has
        its own suffix, the store holds the first ``ext`` tokens of each."""
        config = self.runner.config
        for _ in range(min(count, self.max_requests - self.next_index)):
            i = self.next_index
            prompt = list(LONG_PREFIXES[prefix][:prefix_len]) + [
                10 + i * 7 + k for k in range(suffix_len)]
            prompt = prompt[:min(MAX_WAVE_PROMPT, config.max_model_len - max_tokens)]
            load = self.swarm.load_async(load_async)
            action = {"op": "add", "id": f"r{i}", "prompt": prompt, "max_tokens": max_tokens,
                      "priority": priority, "ext": self._ext(ext, prompt), "async": load,
                      "send": send and config.is_kv_producer
                      and (self.profile.async_load_with_send or not load),
                      "offload": self.swarm.offload(offload) and config.is_kv_consumer}
            # every trace the run saves must replay (kvspec.harness.trace.check_size)
            if self.dead or not is_well_within_limits(config, [*self.runner.actions, action]):
                return
            self.next_index += 1
            self._apply(action)


def machine_for(target: str, on_counterexample=None, kinds=ALL_KINDS,
                profile: EnvProfile = MODELLED, design_rules: bool = True,
                kv: str = "symbolic", deadline: float | None = None,
                scale: str = "small", stats: Counter | None = None) -> type[KVSpecMachine]:
    """A fresh machine class bound to one target (class attributes are per class);
    ``scale`` "production": every run production-sized. Machines given the same
    ``stats`` count into it."""
    base = ProductionMachine if scale == "production" else KVSpecMachine
    return type(f"{base.__name__}_{target.replace(':', '_')}", (base,),
                {"target_name": target, "on_counterexample": staticmethod(on_counterexample)
                 if on_counterexample else None,
                 "stats": Counter() if stats is None else stats, "kinds": tuple(kinds),
                 "profile": profile, "design_rules": design_rules, "kv": kv,
                 "deadline": deadline})
