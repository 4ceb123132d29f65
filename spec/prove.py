"""Z3 obligations: lemmas over unbounded integers, inductive steps of the
per-request invariants over every action, and refutations of historical rules.

Every obligation evaluates the spec's own functions (``arith``, ``predicates``,
``effects``) on Z3 terms: there is no second encoding to drift.
"""
from __future__ import annotations

import time
from typing import Callable

import attrs
import z3

from kvspec.spec import arith
from kvspec.spec.effects import ACTIONS, Counters, request_invariants
from kvspec.spec.logic import And, Implies


@attrs.frozen
class Obligation:
    name: str
    kind: str            # "lemma", "induction" or "refutation"
    build: Callable      # -> (claim, variables dict) ; claim must be valid (or refuted)
    doc: str
    fast: bool = True


@attrs.define
class Result:
    name: str
    kind: str
    status: str          # "proved", "refuted", "unknown"
    expected: str
    seconds: float
    counterexample: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == self.expected


OBLIGATIONS: dict[str, Obligation] = {}


def obligation(kind: str):
    def register(fn):
        OBLIGATIONS[fn.__name__] = Obligation(fn.__name__, kind, fn, (fn.__doc__ or "").strip())
        return fn
    return register


def ints(*names):
    return {n: z3.Int(n) for n in names}


# -- lemmas -------------------------------------------------------------------

@obligation("lemma")
def lemma_hit_leaves_a_token():
    """After a (sync or async) hit of ``local + external`` tokens, the computed
    count is local + external unless that is the whole prompt, never past the
    prompt, and at least one token is left to compute."""
    v = ints("local", "external", "num_tokens")
    c = arith.compute_num_computed_after_hit(v["local"], v["external"], v["num_tokens"])
    pre = And(v["local"] >= 0, v["external"] >= 0, v["num_tokens"] >= 1,
              v["local"] + v["external"] <= v["num_tokens"])
    post = And(c >= 0, c <= v["num_tokens"] - 1, c <= v["local"] + v["external"],
               Implies(v["local"] + v["external"] < v["num_tokens"],
                       c == v["local"] + v["external"]))
    return Implies(pre, post), v


@obligation("lemma")
def lemma_full_prompt_hit():
    """A full-prompt hit recomputes exactly the last token."""
    v = ints("local", "external", "num_tokens")
    c = arith.compute_num_computed_after_hit(v["local"], v["external"], v["num_tokens"])
    pre = And(v["local"] >= 0, v["external"] >= 0, v["num_tokens"] >= 1,
              v["local"] + v["external"] == v["num_tokens"])
    return Implies(pre, c == v["num_tokens"] - 1), v


@obligation("lemma")
def lemma_async_load_counts_hits_exactly():
    """Issuing an async load and finishing it leaves ``num_computed_tokens`` at
    local + external hits (not a block multiple), the full-hit rule aside (#34616)."""
    v = ints("local", "external", "num_tokens", "block_size", "prompt_len", "blocks")
    r = Counters(0, v["prompt_len"], v["num_tokens"], 0, -1, 0, 0, v["blocks"], v["block_size"])
    g1, loading = ACTIONS["async_allocate"][0](r, v["local"], v["external"])
    g2, done = ACTIONS["async_finish"][0](loading)
    want = arith.compute_num_computed_after_hit(v["local"], v["external"], v["num_tokens"])
    pre = And(g1, g2, v["block_size"] >= 1, v["num_tokens"] >= 1)
    return Implies(pre, done.num_computed == want), v


@obligation("lemma")
def lemma_truncation_at_first_invalid_block():
    """Recovery keeps exactly the tokens before the first invalid block: all of
    them lie in earlier blocks, and nothing at or above that block is counted."""
    v = ints("first_invalid", "block_size", "num_computed")
    t = arith.compute_truncated_computed(v["first_invalid"], v["block_size"], v["num_computed"])
    pre = And(v["first_invalid"] >= 0, v["block_size"] >= 1,
              v["first_invalid"] * v["block_size"] < v["num_computed"])
    post = And(t == v["first_invalid"] * v["block_size"], t >= 0, t < v["num_computed"])
    return Implies(pre, post), v


@obligation("lemma")
def lemma_shared_block_has_one_owner():
    """A failed block shared by up to four requests is recomputed by exactly one
    of them when any is affected, and by none otherwise."""
    flags = [z3.Bool(f"affected{i}") for i in range(4)]
    owners = arith.compute_owner_flags(flags)
    count = z3.Sum([z3.If(o, 1, 0) for o in owners])
    return count == z3.If(z3.Or(*flags), 1, 0), {str(f): f for f in flags}


@obligation("lemma")
def lemma_spec_decode_rollback():
    """After drafts are partly rejected, the computed count is exactly one short
    of the tokens (the bonus token is computed next step) and never below the
    tokens computed before the step."""
    v = ints("num_computed", "num_tokens", "num_new", "num_drafts", "num_accepted")
    after = arith.compute_computed_after_rejection(v["num_computed"] + v["num_new"],
                                                   v["num_drafts"], v["num_accepted"])
    pre = And(v["num_drafts"] >= 0, v["num_accepted"] >= 0, v["num_accepted"] <= v["num_drafts"],
              v["num_computed"] + v["num_new"] - v["num_drafts"] == v["num_tokens"],
              v["num_new"] >= 1, v["num_computed"] >= 0, v["num_computed"] <= v["num_tokens"])
    tokens_after = v["num_tokens"] + v["num_accepted"] + 1
    return Implies(pre, And(after == tokens_after - 1, after >= v["num_computed"])), v


@obligation("lemma")
def lemma_lowered_stats_stay_ordered():
    """Failure recovery lowers the stats without breaking their order."""
    v = ints("prompt_len", "cached", "external", "valid")
    cached, external = arith.compute_lowered_stats(v["cached"], v["external"], v["valid"])
    pre = And(v["prompt_len"] >= v["cached"], v["cached"] >= v["external"], v["external"] >= 0,
              v["valid"] >= 0)
    post = And(v["prompt_len"] >= cached, cached >= external, external >= 0,
               cached <= v["cached"], external <= v["external"])
    return Implies(pre, post), v


# -- refutations: the historical rules must come out as counterexamples --------

@obligation("refutation")
def refute_pre_34616_rounding():
    """The pre-#34616 rule (whole allocated blocks, clipped to the prompt, minus
    one on a full hit) differs from local + external hits. Expected: refuted,
    with external hits ending mid-block before the prompt end (the seed's case)."""
    v = ints("external", "num_tokens", "block_size")
    blocks = arith.cdiv(v["external"], v["block_size"])
    old = arith.compute_num_computed_pre_34616(blocks, v["block_size"], v["num_tokens"])
    new = arith.compute_num_computed_after_hit(0, v["external"], v["num_tokens"])
    pre = And(v["external"] >= 1, v["external"] <= v["num_tokens"], v["block_size"] >= 2,
              v["block_size"] <= 4, v["num_tokens"] <= 12)
    return Implies(pre, old == new), v


@obligation("refutation")
def refute_stats_reset_on_reschedule():
    """Re-setting ``num_external_computed_tokens`` at a re-scheduling while
    ``num_cached_tokens`` keeps the first value (#36859). Expected: refuted: the
    stats leave their order."""
    v = ints("prompt_len", "local1", "ext1", "local2", "ext2")
    cached, _ = arith.compute_first_stats(v["local1"], v["ext1"], v["prompt_len"])
    _, external2 = arith.compute_first_stats(v["local2"], v["ext2"], v["prompt_len"])
    pre = And(v["prompt_len"] >= 1, v["prompt_len"] <= 3,
              *[And(v[a] >= 0, v[b] >= 0, v[a] + v[b] <= v["prompt_len"])
                for a, b in (("local1", "ext1"), ("local2", "ext2"))])
    return Implies(pre, cached >= external2), v


@obligation("refutation")
def refute_truncate_past_first_invalid():
    """Recovery that cuts after the first invalid block instead of before it.
    Expected: refuted: the invalid block stays counted."""
    v = ints("first_invalid", "block_size", "num_computed")
    cut = arith.Min(v["num_computed"], (v["first_invalid"] + 1) * v["block_size"])
    pre = And(v["first_invalid"] >= 0, v["block_size"] >= 2, v["block_size"] <= 4,
              v["first_invalid"] * v["block_size"] < v["num_computed"], v["num_computed"] <= 12)
    return Implies(pre, cut <= v["first_invalid"] * v["block_size"]), v


# -- induction: each per-request invariant is preserved by every action -------

def _symbolic_request(prefix: str) -> tuple[Counters, dict]:
    names = ["status", "prompt_len", "num_tokens", "num_computed", "num_cached",
             "num_external", "num_preemptions", "num_blocks", "block_size"]
    v = {n: z3.Int(f"{prefix}{n}") for n in names}
    return Counters(**v), v


def _induction(action: str, invariant: str):
    def build():
        fn, params = ACTIONS[action]
        r, v = _symbolic_request("")
        p = {n: z3.Int(n) for n in params}
        guard, after = fn(r, *p.values())
        before = request_invariants(r)
        status_ok = And(r.status >= 0, r.status <= 3)
        claim = Implies(And(status_ok, guard, *before.values()),
                        request_invariants(after)[invariant])
        return claim, {**v, **p}
    return build


def _register_induction():
    invariants = request_invariants(_symbolic_request("x")[0])
    for action in ACTIONS:
        for invariant in invariants:
            name = f"inductive_{invariant}_under_{action}"
            OBLIGATIONS[name] = Obligation(
                name, "induction", _induction(action, invariant),
                f"{invariant} holds after {action} whenever every per-request invariant "
                f"held before and the action's guard holds.")


_register_induction()


def _pool_induction(action: str, invariant: str):
    from kvspec.spec.pool_effects import NUM_BLOCKS, NUM_REQUESTS, POOL_ACTIONS, Pool, pool_invariants

    def build():
        holds = tuple(tuple(z3.Bool(f"holds_{r}_{b}") for b in range(NUM_BLOCKS))
                      for r in range(NUM_REQUESTS))
        ref = tuple(z3.Int(f"ref_{b}") for b in range(NUM_BLOCKS))
        free = tuple(z3.Bool(f"free_{b}") for b in range(NUM_BLOCKS))
        pool = Pool(holds, ref, free)
        fn, params = POOL_ACTIONS[action]
        ranges = {"r": range(NUM_REQUESTS), "b": range(NUM_BLOCKS)}
        before = And(*pool_invariants(pool).values())
        claims = []
        for choice in _choices(params, ranges):
            guard, after = fn(pool, *choice)
            claims.append(Implies(And(before, guard), pool_invariants(after)[invariant]))
        variables = {str(v): v for v in (*[h for row in holds for h in row], *ref, *free)}
        return And(*claims), variables
    return build


def _choices(params, ranges):
    if not params:
        return [()]
    return [(first, *rest) for first in ranges[params[0]] for rest in _choices(params[1:], ranges)]


def _register_pool_induction():
    from kvspec.spec.pool_effects import NUM_BLOCKS, NUM_REQUESTS, POOL_ACTIONS
    for action in POOL_ACTIONS:
        for invariant in ("ref_count_is_holders", "free_queue_is_free_blocks"):
            name = f"pool_inductive_{invariant}_under_{action}"
            OBLIGATIONS[name] = Obligation(
                name, "induction", _pool_induction(action, invariant),
                f"{invariant} holds after the pool action {action} (every request, every "
                f"block) over a symbolic pool of {NUM_REQUESTS} requests and {NUM_BLOCKS} "
                f"blocks with unbounded counts, when both pool invariants held before.")


_register_pool_induction()


# -- running ------------------------------------------------------------------

def check(ob: Obligation, timeout_ms: int = 10_000) -> Result:
    expected = "refuted" if ob.kind == "refutation" else "proved"
    start = time.perf_counter()
    claim, variables = ob.build()
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    solver.add(z3.Not(claim))
    outcome = solver.check()
    seconds = time.perf_counter() - start
    if outcome == z3.unsat:
        return Result(ob.name, ob.kind, "proved", expected, seconds)
    if outcome == z3.sat:
        model = solver.model()
        cex = {k: _value(model.eval(v, model_completion=True)) for k, v in variables.items()}
        return Result(ob.name, ob.kind, "refuted", expected, seconds, cex)
    return Result(ob.name, ob.kind, "unknown", expected, seconds)


def _value(term):
    if z3.is_int_value(term):
        return term.as_long()
    if z3.is_true(term) or z3.is_false(term):
        return z3.is_true(term)
    return str(term)


def check_all(names=None, timeout_ms: int = 10_000) -> list[Result]:
    return [check(ob, timeout_ms) for name, ob in OBLIGATIONS.items()
            if names is None or name in names]
