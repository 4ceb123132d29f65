"""The connector contract: what vLLM's scheduler relies on a KV connector's
scheduler side to answer. These claims judge the connector, not the scheduler
(role ``contract``): a breach is the connector's finding.

Each claim is evaluated on one connector call (a ``ConnectorCall``), recorded
as the scheduler makes it: a lookup (``get_num_new_matched_tokens``), a load
(``update_state_after_alloc`` with external tokens, and the blocks the
connector's own metadata then names), a store (what the connector's metadata
asked its worker to save, as the worker read it), a finish
(``request_finished``). What
the outside world knows beside the answer (what a store holds, whether a
transfer still reads a request's blocks) comes from kvspec's environment, or,
for a real connector, from the world kvspec plays around it
(``kvspec/harness/connector_worlds.py``); where nothing is known, the claim is
not evaluated on that call and not witnessed.

kvspec's own connector (``kvspec/harness/env.py``) keeps every claim by
construction, except on an arrival marked ``beyond_contract``, which steps
outside on purpose and is not judged here.
"""
from __future__ import annotations

from typing import Iterator

import attrs

from kvspec.spec.registry import Witnessing, invariant


@attrs.define
class ConnectorCall(Witnessing):
    """One scheduler-side connector call and what was known when it was made."""

    #: "lookup", "load", "store" or "finish"
    op: str
    request_id: str
    #: the request's tokens (prompt and output) and prompt length at the call
    num_tokens: int = 0
    #: lookup: the locally computed tokens the scheduler asked from
    num_computed: int = 0
    #: lookup: the answer, ``num_external`` None for "not known yet"
    num_external: int | None = 0
    is_async: bool = False
    #: lookup: the layout has a last-state (Mamba) group
    has_last_state: bool = False
    #: lookup: an async load of this request finished since its last preemption
    load_delivered: bool = False
    #: lookup: tokens of this request's prefix the store holds (None: unknown)
    stored: int | None = None
    #: load: the blocks the scheduler gave (``update_state_after_alloc``) and
    #: those the connector's metadata loads into (None: unknown)
    given_blocks: frozenset = frozenset()
    load_blocks: frozenset | None = None
    #: load: how many positions it loads, and how many of them the store does
    #: not hold (None: unknown)
    num_loaded: int = 0
    num_unstored: int | None = None
    #: store: positions a store took, and those of them that did not hold their
    #: valid KV when it read them
    num_stored: int = 0
    bad_positions: tuple[int, ...] = ()
    #: finish: the connector's answer, and whether a transfer kvspec's world
    #: runs still reads the request's blocks (None: unknown)
    delay: bool = False
    reads_in_flight: bool | None = None
    #: lookup: the answer as given, when it is not of the API's types
    #: (``num_external`` is then None: no other claim reads it)
    malformed: str = ""
    #: report: a transfer ("load" or "send") the connector's
    #: ``update_connector_output`` added to the worker's report, and what was
    #: known of it (``REPORT_STATES``)
    transfer: str = ""
    report_state: str = ""

    witnessed: int = 0

    @property
    def hit_end(self) -> int:
        return self.num_computed + (self.num_external or 0)

    @property
    def is_hit(self) -> bool:
        return bool(self.num_external)

    @property
    def covers_every_token(self) -> bool:
        """The hit leaves the step nothing to compute."""
        return self.hit_end >= self.num_tokens


@invariant(cites="KVConnectorBase_V1.get_num_new_matched_tokens (base.py): returns "
                 "tuple[int | None, bool]", kind="connector", role="contract", action="lookup")
def lookup_answer_has_the_api_types(c: ConnectorCall) -> Iterator[str]:
    """A lookup answers a pair: the tokens it can load (an integer, not a bool,
    or None: ask again later) and whether it loads them asynchronously (a
    bool; an integer, whose truth is as plain, passes too).

    Protects the scheduler from an answer it unpacks as something else: vLLM
    takes any pair apart without a check, so another shape fails deep inside
    ``schedule()``, where it reads as a scheduler crash. kvspec stops the call
    instead and names the answer."""
    c.witness()
    if c.malformed:
        yield (f"{c.request_id}: get_num_new_matched_tokens answered {c.malformed}, not "
               "(num_tokens or None, load_async)")


@invariant(cites="KVConnectorBase_V1.get_num_new_matched_tokens (base.py): load_async "
                 "'Must be False if the first element is 0'; vLLM 0.32 asserts "
                 "num_external_computed_tokens > 0 for an async load", kind="connector",
           role="contract", action="lookup")
def async_load_has_tokens(c: ConnectorCall) -> Iterator[str]:
    """An answer asks for an asynchronous load only with tokens to load.

    Protects the engine: vLLM parks a request with an async answer in
    WAITING_FOR_REMOTE_KVS and asserts that it has external tokens, so an
    async answer of 0 stops the engine with an AssertionError in the
    scheduler, far from the connector that caused it."""
    if c.num_external is None or not c.is_async:
        return
    c.witness()
    if c.num_external <= 0:
        yield (f"{c.request_id}: the connector answered an asynchronous load of "
               f"{c.num_external} tokens")


@invariant(cites="KVConnectorBase_V1.get_num_new_matched_tokens (base.py): tokens 'beyond "
                 "what is already computed'; impl/connector.py", kind="connector",
           role="contract", action="lookup")
def hit_within_uncomputed_tokens(c: ConnectorCall) -> Iterator[str]:
    """A hit never claims more tokens than the request has left to compute.

    The scheduler allocates ``num_computed + num_external`` slots and sets the
    request's computed count to that sum: vLLM 0.32 asserts the sum is within
    the request's tokens (a larger answer stops the engine), and takes a
    negative answer as it is, recomputing positions it already holds."""
    if c.num_external is None:
        return
    c.witness()
    if not 0 <= c.num_external <= c.num_tokens - c.num_computed:
        yield (f"{c.request_id}: the connector claimed {c.num_external} external tokens with "
               f"{c.num_computed} of {c.num_tokens} computed")


@invariant(cites="finding sync-full-prompt-hit-crash (docs/findings); ExampleConnector and "
                 "LMCacheConnectorV1 leave the last prompt token (align_to_block_size(n - 1))",
           kind="connector", role="contract", action="lookup")
def sync_hit_leaves_a_token(c: ConnectorCall) -> Iterator[str]:
    """A synchronous hit leaves at least one token for the step to compute.

    A step must compute a token to sample the next one; a sync hit of every
    token leaves the scheduler a request with nothing to schedule (vLLM 0.32
    raises or stalls on it: the finding). Every in-tree sync connector backs
    off one token; an async hit may cover the whole prompt (the scheduler
    recomputes the last token when the load lands)."""
    if not c.is_hit or c.is_async:
        return
    c.witness()
    if c.covers_every_token:
        yield (f"{c.request_id}: a synchronous hit of {c.num_external} tokens from "
               f"{c.num_computed} covers all {c.num_tokens} tokens")


@invariant(cites="NixlConnector _prefill_backoff (Mamba); the offloading connectors cap hits "
                 "at n - 1 with a Mamba group; finding hybrid-full-prompt-hit-window-freed",
           kind="connector", role="contract", action="lookup")
def hit_with_last_state_leaves_last_token(c: ConnectorCall) -> Iterator[str]:
    """With a last-state (Mamba) group, any hit, async too, leaves the last token.

    An align-mode Mamba block keeps the state after its last position only: a
    recompute from ``n - 1`` would read the state after ``n`` as if it were
    the state after ``n - 1``. So the scheduler needs the hit to end before
    the last token. A one-token prompt is the exception: its whole hit is
    recomputed from position 0 (``_update_waiting_for_remote_kv`` sets the count
    to ``n - 1``), which reads no state, and the P/D connectors load such a
    prompt whole on purpose (NixlConnector ``num_prompt_tokens > backoff``,
    MooncakeConnector ``num_prompt_tokens > 1``)."""
    if not c.is_hit or not c.has_last_state:
        return
    c.witness()
    if c.covers_every_token and c.num_tokens > 1:
        yield (f"{c.request_id}: a hit of {c.num_external} tokens from {c.num_computed} covers "
               f"all {c.num_tokens} tokens beside a last-state group")


@invariant(cites="finding one-token-async-hit-livelock; NixlConnector clears "
                 "do_remote_prefill in update_state_after_alloc", kind="connector",
           role="contract", action="lookup",
           unwitnessed_because="""a scheduler asks its connector again after a landed load
           only when the load left nothing computed (vLLM, for a one-token prompt), which few
           runs draw; the reference scheduler keeps a landed load's tokens and never asks""")
def finished_load_not_offered_again(c: ConnectorCall) -> Iterator[str]:
    """A load that landed is not offered again until the request is preempted.

    The scheduler asks the connector again whenever a waiting request has
    nothing computed, which a landed load leaves when it covered a one-token
    prompt (the scheduler recomputes its last token); a connector that offers
    the same tokens again sends it back to WAITING_FOR_REMOTE_KVS for ever."""
    if c.num_external is None or not c.load_delivered:
        return
    c.witness()
    if c.num_external:
        yield (f"{c.request_id}: its load landed, and the connector offered "
               f"{c.num_external} tokens again before any preemption")


@invariant(cites="issue 29 (a hit counted past what was stored); OffloadingManager.lookup, "
                 "ExampleConnector._found_match_for_prompt", kind="connector", role="contract",
           action="lookup")
def hit_within_stored(c: ConnectorCall) -> Iterator[str]:
    """A hit ends within what the store holds of the request's prefix, from
    where the lookup starts (the tokens before it are the local prefix
    cache's).

    A load of tokens nobody stored writes whatever the store's slots hold into
    blocks the scheduler then counts as computed, and the prefix cache offers
    them to every request sharing the prefix."""
    if not c.is_hit or c.stored is None:
        return
    c.witness()
    if c.hit_end > c.stored:
        yield (f"{c.request_id}: a hit of tokens {c.num_computed}..{c.hit_end}, but from "
               f"token {c.num_computed} the store holds its prefix up to token {c.stored}")


@invariant(cites="KVConnectorBase_V1.update_state_after_alloc (base.py): the blocks given "
                 "receive the external tokens", kind="connector", role="contract",
           action="load")
def load_lands_in_given_blocks(c: ConnectorCall) -> Iterator[str]:
    """A load writes only into the blocks the scheduler gave the connector.

    Any other block belongs to another request or to the prefix cache: a load
    there overwrites KV someone else reads."""
    if c.load_blocks is None:
        return
    c.witness()
    stray = sorted(c.load_blocks - c.given_blocks)
    if stray:
        yield (f"{c.request_id}: its load writes blocks {stray}, not among the blocks "
               f"the scheduler gave ({sorted(c.given_blocks)})")


@invariant(cites="ExampleConnector: its lookup keys a prompt by (n - 2) // block * block "
                 "tokens, its load by (n - 1) // block * block", kind="connector",
           role="contract", action="load")
def load_reads_what_was_stored(c: ConnectorCall) -> Iterator[str]:
    """A load asks the store only for KV it holds.

    The lookup promised the hit; a load of another key finds nothing (the
    worker fails, or brings whatever it reads) while the scheduler already
    counts the tokens as computed."""
    if c.num_unstored is None or not c.num_loaded:
        return
    c.witness()
    if c.num_unstored:
        yield (f"{c.request_id}: its load asks for {c.num_loaded} positions, {c.num_unstored} "
               "of them never stored")


@invariant(cites="KVConnectorBase_V1.request_finished (base.py): returns "
                 "tuple[bool, dict[str, Any] | None]", kind="connector", role="contract",
           action="finish")
def finish_answer_has_the_api_types(c: ConnectorCall) -> Iterator[str]:
    """A finished request's answer is a pair: whether to delay freeing its
    blocks (a bool) and the KV transfer parameters to hand back (a dict, or
    None).

    Protects the scheduler from an answer it unpacks as something else: vLLM
    takes the pair apart without a check in ``_connector_finished``, so another
    shape fails there and reads as a scheduler crash. kvspec stops the call
    instead and names the answer."""
    c.witness()
    if c.malformed:
        yield (f"{c.request_id}: request_finished answered {c.malformed}, not "
               "(delay_free_blocks, kv_transfer_params or None)")


@invariant(cites="KVConnectorBase_V1.build_connector_meta (base.py): returns "
                 "KVConnectorMetadata; the worker asserts scheduler_output."
                 "kv_connector_metadata is not None (kv_connector_model_runner_mixin.py)",
           kind="connector", role="contract", action="meta", unwitnessed_because="""
           judges a real connector's build_connector_meta (--connector); kvspec's own
           connector builds none""")
def meta_is_connector_metadata(c: ConnectorCall) -> Iterator[str]:
    """Each step's ``build_connector_meta`` returns the connector's metadata,
    never None (a MultiConnector's part for each child too).

    Protects the worker, which asserts the step's metadata is there and binds
    it before the forward pass: a method that forgets its ``return`` stops the
    engine on its first step, in the model runner, far from the connector.
    kvspec plays the worker, so without this claim such a connector held."""
    c.witness()
    if c.malformed:
        yield f"build_connector_meta returned {c.malformed}"


#: what was known of a transfer a connector's ``update_connector_output``
#: added to the worker's report: a report it held back earlier (passed on
#: late, which the API allows) or one it had no worker report of
REPORT_STATES = {
    "withheld": "",
    "passed_on": "the worker's report of it was already passed on",
    "in_flight": "the worker has not reported it finished",
    "never_started": "no asynchronous load of it was started",
    "not_delayed": "request_finished did not delay its free",
    "not_finished": "it has not finished (a send frees a finished request's blocks)",
}


@invariant(cites="Scheduler._update_from_kv_xfer_finished (scheduler.py): calls "
                 "update_connector_output, then trusts finished_recving and finished_sending "
                 "(vLLM 0.32 asserts each request's status)", kind="connector",
           role="contract", action="report", unwitnessed_because="""
           judges a connector whose update_connector_output adds transfers to the worker's
           report (held back ones passed on later); kvspec's own connector and most in-tree
           ones never add any""")
def report_names_finished_transfers(c: ConnectorCall) -> Iterator[str]:
    """A connector's ``update_connector_output`` adds to the worker's report
    only transfers the worker reported finished: a load or send it held back
    from an earlier report may be passed on late, no other.

    Protects the scheduler, which trusts the report after that call: a load
    named finished before its KV landed is computed on (the step reads blocks
    nothing wrote), one never started or named twice fails vLLM's status
    asserts, and a send named finished frees blocks still read, or a request
    already gone. Such a crash reads as the scheduler's; the claim names the
    connector."""
    c.witness()
    why = REPORT_STATES.get(c.report_state, c.report_state)
    if why:
        where = "finished_recving" if c.transfer == "load" else "finished_sending"
        yield (f"{c.request_id}: update_connector_output added it to {where}, but {why}")


@invariant(cites="KVConnectorBase_V1.request_finished (base.py): delay the free while blocks "
                 "are sent or saved asynchronously; RFC #57187", kind="connector",
           role="contract", action="finish")
def delay_covers_reads_in_flight(c: ConnectorCall) -> Iterator[str]:
    """A finished request's free is delayed while a transfer still reads its blocks.

    Without the delay the scheduler frees the blocks at once and may hand them
    to another request in the next step, while the send or store still reads
    them: the far side receives the new request's KV."""
    if c.reads_in_flight is None or not c.reads_in_flight:
        return
    c.witness()
    if not c.delay:
        yield (f"{c.request_id}: a transfer still reads its blocks, and the connector "
               "let the scheduler free them at once")


@invariant(cites="KVConnectorBase_V1.save_kv_layer / build_connector_meta (base.py); "
                 "ExampleConnector saves the whole prompt at its first chunk", kind="connector",
           role="contract", action="store",
           unwitnessed_because="""kvspec's own offloading store keeps the computed prefix by
           construction and is not judged; the claim judges a real connector's stores
           (--connector, ExampleConnector's world)""")
def store_reads_computed_kv(c: ConnectorCall) -> Iterator[str]:
    """A store saves only positions holding their computed KV when it reads them.

    Under chunked prefill a request's later positions are computed in later
    steps; a store that reads them earlier saves whatever the blocks held. A
    store still reading after the scheduler reused its blocks (a delayed free
    or fence the connector did not ask for) saves another request's KV.
    Either way every later hit on that prefix loads it as the prompt's KV."""
    if not c.num_stored:
        return
    c.witness()
    if c.bad_positions:
        shown = ", ".join(map(str, c.bad_positions[:6])) + (
            ", ..." if len(c.bad_positions) > 6 else "")
        yield (f"{c.request_id}: the connector stored {c.num_stored} positions, of which "
               f"{len(c.bad_positions)} did not hold their computed KV when read "
               f"(positions [{shown}])")
