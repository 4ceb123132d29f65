"""The environment: everything outside the scheduler, chosen by the fuzzer.

Fault model, written down first:
- the external KV store holds, for each request, a prefix of its prompt
  (``ext`` tokens) and answers the connector's queries about it; it may answer
  "not yet" (None) a bounded number of times per request; an offloading store
  also keeps the prefix a running request has computed, so a reload after a
  preemption can cover more than the first scheduling did;
- a load may be sync (runs in the step its request is scheduled) or async
  (completes in a later step the environment picks); any load may fail on one
  or several consecutive blocks (a bad block, or a transfer that broke off),
  which are then reported in ``invalid_block_ids``;
- a finished request may hold its blocks for a KV send, finished in a later step;
- P/D disaggregation: on a consumer (decode node) a request may arrive with
  ``do_remote_prefill`` (``pd``): a prefill node computed its whole prompt,
  which arrives by an async load; on a producer (prefill node) one may arrive
  with ``do_remote_decode``: it sends its KV when finished. The connector then
  drops the remote-prefill flag once the blocks are allocated, as NIXL does:
  a request preempted after that recomputes locally;
- the model samples deterministic tokens, or EOS when the environment says so;
  spec decode proposes drafts and the environment picks how many are accepted;
- clients abort requests at any time; the operator may reset the prefix cache.
A conforming connector never claims more external tokens than the request has
uncomputed (``ext <= num_tokens - num_local``). Answers outside that contract
are an environment contract violation, reported apart from scheduler bugs.

The connector also keeps to what vLLM's in-tree connectors do (the connector
contract, docs/findings/README.md): a synchronous hit never covers a request's
last token (the sync connectors leave it, and say so), nor does any hit with a
last-state (Mamba) group (NIXL backs off one token for Mamba, the offloading
connectors cap hits at ``n - 1`` then), and a load that finished
is not offered again until the request is preempted (P/D connectors clear their
remote-prefill flag once the blocks are allocated; store connectors offer whole
blocks, so never a one-token prompt). An arrival marked ``beyond_contract``
steps outside both on purpose: the findings that depend on it replay that way.
"""
from __future__ import annotations

import attrs

from kvspec.spec.contract import ConnectorCall
from kvspec.spec.oracle import KVContent

EOS_TOKEN_ID = 0
VOCAB = 7


def sampled_token(request_id: str, position: int) -> int:
    """The model's deterministic token at a position (never EOS): a Python
    int, as a real sampler's ``tolist()`` gives, whatever type the position
    came in (a connector may answer a numpy int hit)."""
    return 1 + (sum(map(ord, request_id)) * 31 + int(position) * 17) % VOCAB


def draft_token(request_id: str, position: int, k: int) -> int:
    """A draft guess: right for the first drafts, wrong once ``k`` passes 1."""
    return sampled_token(request_id, position) if k < 2 else 1 + VOCAB


@attrs.frozen
class RequestSpec:
    """A request and the environment's plan for it."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    ext: int = 0            # prompt tokens the external store holds
    load_async: bool = False
    none_answers: int = 0   # times the connector answers None first
    send: bool = False      # delay free for a KV send when finished
    offload: bool = False   # the store also keeps what the request computes (offloading)
    #: the connector answers outside vLLM's in-tree contract (see the module doc)
    beyond_contract: bool = False
    #: P/D ``kv_transfer_params``: do_remote_prefill on a consumer, do_remote_decode
    #: on a producer (the module doc)
    pd: bool = False


class EnvironmentContractViolation(Exception):
    """The environment (not the scheduler) stepped outside its contract."""


def get_request_spec(a: dict) -> RequestSpec:
    """The request an ``add`` action makes, and the environment's plan for it."""
    spec = RequestSpec(a["id"], tuple(a["prompt"]), a["max_tokens"], a.get("priority", 0),
                       a.get("ext", 0), a.get("async", False), a.get("none", 0),
                       a.get("send", False), a.get("offload", False),
                       # an overclaim is outside the contract by definition
                       a.get("beyond_contract", False) or a.get("overclaim_ok", False),
                       a.get("pd", False))
    if spec.ext > len(spec.prompt) and not a.get("overclaim_ok"):
        raise EnvironmentContractViolation(
            f"the store cannot hold {spec.ext} tokens of a {len(spec.prompt)}-token prompt")
    return spec


class EnvConnector:
    """A programmable KV connector: its answers come from the environment."""

    def __init__(self, content: KVContent, observe_request) -> None:
        self.content = content
        self.observe_request = observe_request
        self.plans: dict[str, RequestSpec] = {}
        #: requests whose latest lookup answered "not known yet" (None)
        self.undecided: set[str] = set()
        #: requests whose finished load a real connector's
        #: ``update_connector_output`` took out of the worker's report and has
        #: not passed on since
        self.held_back: set[str] = set()
        self.none_left: dict[str, int] = {}
        self.offloaded: dict[str, int] = {}
        #: the latest answer per request: (num_local, num_external); a load
        #: starts at num_local
        self.answers: dict[str, tuple[int, int]] = {}
        #: every answer in order: (request id, num_local, num_external)
        self.answer_log: list[tuple[str, int, int]] = []
        #: request id -> its preemption count when an async load of it finished
        self.delivered: dict[str, int] = {}
        #: P/D requests whose remote prefill was allocated: never offered again
        self.remote_prefill_taken: set[str] = set()
        #: connector calls not judged yet by the contract (spec/contract.py)
        self.calls: list[ConnectorCall] = []

    def take_calls(self) -> list[ConnectorCall]:
        calls, self.calls = self.calls, []
        return calls

    def is_judged(self, request_id: str) -> bool:
        """The contract judges the answers about this request (not an arrival
        that steps outside it on purpose)."""
        plan = self.plans.get(request_id)
        return plan is None or not plan.beyond_contract

    def record_malformed_lookup(self, request, num_computed: int, answer, problem: str) -> None:
        """A lookup answered outside the API's types (``problem`` says how): the
        call the contract judges (``lookup_answer_has_the_api_types``), whoever
        the request is."""
        self.calls.append(ConnectorCall("lookup", request.request_id, request.num_tokens,
                                        num_computed, None,
                                        malformed=f"{repr(answer)[:200]} ({problem})"))

    def record_lookup(self, request, num_computed: int, answer, stored: int | None) -> None:
        """A lookup's answer: the latest per request (a load starts at
        ``num_computed``), the log, and the call the contract judges."""
        num_external, is_async = answer
        rid = request.request_id
        if num_external is None:
            self.undecided.add(rid)
        else:
            self.undecided.discard(rid)
        if num_external is not None:
            self.answers[rid] = (num_computed, num_external)
            self.answer_log.append((rid, num_computed, num_external))
        if self.is_judged(rid):
            self.calls.append(ConnectorCall(
                "lookup", rid, request.num_tokens, num_computed, num_external, bool(is_async),
                self.has_last_state, self.delivered.get(rid) == request.num_preemptions,
                stored))

    def note_computed(self, request_id: str, num_computed: int, num_tokens: int) -> None:
        """An offloading store saves a running request's computed prefix."""
        plan = self.plans.get(request_id)
        if plan is not None and plan.offload:
            self.offloaded[request_id] = max(self.offloaded.get(request_id, 0),
                                             min(num_computed, num_tokens))

    def plan(self, spec: RequestSpec) -> None:
        self.plans[spec.request_id] = spec
        self.none_left[spec.request_id] = spec.none_answers

    # -- the connector API the scheduler calls -----------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        rid = request.request_id
        plan = self.plans[rid]
        if self.none_left.get(rid, 0) > 0:
            self.none_left[rid] -= 1
            return None, False
        stored = max(plan.ext, self.offloaded.get(rid, 0))
        num_external = max(0, stored - num_computed_tokens)
        if not plan.beyond_contract:
            num_external = self._within_contract(request, num_computed_tokens, num_external)
        answer = num_external, plan.load_async and num_external > 0
        self.record_lookup(request, num_computed_tokens, answer, stored)
        return answer

    def _within_contract(self, request, num_local: int, num_external: int) -> int:
        """The answer an in-tree connector would give (see the module doc)."""
        rid = request.request_id
        if self.delivered.get(rid) == request.num_preemptions:
            return 0  # its load finished: not offered again before a preemption
        if rid in self.remote_prefill_taken:
            return 0  # P/D: the remote prefill is consumed once
        if not self.plans[rid].load_async or self.has_last_state:
            return min(num_external, max(0, request.num_tokens - 1 - num_local))
        return num_external

    @property
    def has_last_state(self) -> bool:
        """A last-state (Mamba) group: every hit leaves the last token, async too.
        A step from ``n - 1`` reads the state after ``n - 1`` tokens, which an
        align-mode Mamba block holding the state after ``n`` no longer has, so
        NIXL backs a remote prefill off by one token for Mamba
        (``_prefill_backoff``) and the offloading connectors cap hits at
        ``n - 1`` with such groups."""
        return any(g.kind == "last_state" for g in self.content.groups)

    def note_local_hits(self, step) -> None:
        """Without a connector nothing is asked: the local hit a request started
        from (``num_computed_before`` of a step that took it from waiting) is
        recorded as the answer a connector with nothing to offer would give."""
        for rid in (*step.new_req_ids, *step.resumed_req_ids):
            self.answers[rid] = (step.num_computed_before[rid], 0)
            self.answer_log.append((rid, step.num_computed_before[rid], 0))

    def note_load_finished(self, request_id: str, num_preemptions: int) -> None:
        """An async load of this request finished without a failure."""
        self.delivered[request_id] = num_preemptions

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        if self.plans[request.request_id].pd:
            self.remote_prefill_taken.add(request.request_id)
        view = self.observe_request(request.request_id)
        start, _ = self.answers.get(request.request_id, (0, 0))
        self.content.add_load(view, block_ids, start, num_external_tokens,
                              self.plans[request.request_id].load_async)
        self.record_load(request.request_id, block_ids, block_ids, num_external_tokens, 0)

    def record_load(self, request_id: str, given, loaded, num_loaded: int = 0,
                    num_unstored: int | None = None) -> None:
        """A load: the blocks the scheduler gave, those it writes (None:
        unknown), and how many of its positions the store lacks."""
        if self.is_judged(request_id):
            flat = (lambda tables: frozenset(b for t in tables for b in t))
            self.calls.append(ConnectorCall(
                "load", request_id, given_blocks=flat(given),
                load_blocks=None if loaded is None else flat(loaded), num_loaded=num_loaded,
                num_unstored=num_unstored))

    def record_store(self, request_id: str, num_stored: int, bad_positions: tuple) -> None:
        """A store a real connector's worker ran: positions it saved, and those
        that did not hold their computed KV when it read them."""
        if self.is_judged(request_id):
            self.calls.append(ConnectorCall("store", request_id, num_stored=num_stored,
                                            bad_positions=bad_positions))

    def record_malformed_finish(self, request_id: str, answer, problem: str) -> None:
        """``request_finished`` answered outside the API's types: the call the
        contract judges (``finish_answer_has_the_api_types``), whoever the
        request is."""
        self.calls.append(ConnectorCall("finish", request_id, reads_in_flight=None,
                                        malformed=f"{repr(answer)[:200]} ({problem})"))

    def record_meta(self, problem: str) -> None:
        """A real connector's step metadata, and what is wrong with it ("":
        nothing): judged by ``meta_is_connector_metadata``."""
        self.calls.append(ConnectorCall("meta", "", malformed=problem))

    def record_report(self, request_id: str, transfer: str, state: str) -> None:
        """A transfer a connector's ``update_connector_output`` added to the
        worker's report, and what was known of it (``REPORT_STATES``)."""
        if self.is_judged(request_id):
            self.calls.append(ConnectorCall("report", request_id, transfer=transfer,
                                            report_state=state))

    def record_finish(self, request_id: str, delay: bool, reads_in_flight: bool | None) -> None:
        if self.is_judged(request_id):
            self.calls.append(ConnectorCall("finish", request_id, delay=bool(delay),
                                            reads_in_flight=reads_in_flight))

    def build_connector_meta(self, scheduler_output):
        return None

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self.content.cancel_load(rid)  # an in-flight load of a finished request is dropped
        plan = self.plans.get(rid)
        sends = plan is not None and plan.send and any(block_ids)
        # kvspec's world reads the blocks exactly when its connector sends
        self.record_finish(rid, sends, sends)
        if not sends:
            return False, None
        # #27644: the real boundary excludes placeholders (async scheduling); like
        # vLLM's in-tree connectors, never past the known tokens
        real = request.num_computed_tokens - getattr(request, "num_output_placeholders", 0)
        self.content.start_send(rid, block_ids[0], min(real, request.num_tokens))
        return True, {"send": rid}


class ConnectorAnswerError(ValueError):
    """A connector answered outside the API's types: recorded for the contract
    (``record_malformed_lookup``), and raised so that the scheduler never uses
    the answer; the run reports the contract claim, not a scheduler crash.
    Raised too where a connector's kvspec hook (``kvspec_stored_end``) fails or
    answers out of range: the connector's, not the scheduler's."""
