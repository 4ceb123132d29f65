"""Liveness: what must eventually happen once faults stop (the healed phase)."""
from __future__ import annotations

from kvspec.spec.registry import invariant


@invariant(cites="seed 004 (_update_waiting_for_remote_kv)", kind="liveness")
def every_request_finishes(ctx):
    """With no new failures and no new arrivals, and every load and send
    completing, every request finishes within a bounded number of steps (the
    sum of its remaining tokens, plus slack), and a request whose load finished
    leaves WAITING_FOR_REMOTE_KVS.

    Protects users from requests that hang forever: a load reported finished
    that the scheduler never picks up, a waiter on a block nobody recomputes.
    Witnessed by each request still live when the healed phase starts."""
    ctx.witness(len(ctx.ghost.draining))
    for r in ctx.live():
        yield f"{r.request_id} still {r.status.name} (computed {r.num_computed_tokens}/{r.num_tokens}) after the healed phase"
