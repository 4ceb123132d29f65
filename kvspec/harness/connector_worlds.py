"""A real connector's scheduler side inside the vllm target (``--connector``).

vLLM builds the connector named in ``kv_transfer_config`` itself; kvspec plays
everything around it: the worker side (loads land or fail, sends and stores
finish), and the outside world (what a store holds). The connector's answers
are its own. A probe wraps the scheduler-side calls vLLM makes on that one
instance, records each for the connector contract (``spec/contract.py``) and
tells the data oracle what the connector asked its worker to do.

A *world* is what kvspec knows of one connector's transfers:

- ``GenericWorld`` (any connector, in-tree or not): a load writes the blocks
  ``update_state_after_alloc`` gave, from the position the lookup started at,
  and brings the KV the hit claims (kvspec cannot see the store, so it takes
  the connector's word); a delayed free is a send kvspec finishes later. The
  claims that need the store's contents or the connector's metadata are not
  evaluated (and say so: not witnessed).
- ``ExampleWorld`` (vLLM's ``ExampleConnector``): the store is the folder
  tree the connector looks up; kvspec's worker reads the connector's
  metadata (``ExampleConnectorMetadata``: per request, token ids, slot mapping,
  load or store), saves what the named blocks hold when the step's output
  returns (the connector's worker saves during the forward) and loads it back
  as it was saved. An arrival with ``ext`` tokens in the plan finds the
  prompt already saved by another instance (its valid KV).
- ``OffloadingWorld``, ``NixlWorld``, ``MooncakeWorld``,
  ``SimpleCPUOffloadWorld``, ``MooncakeStoreWorld``, ``HF3FSWorld``,
  ``MultiWorld``: each class says what it plays (store and load jobs with
  their completions; P/D pulls; a MultiConnector's children).
"""
from __future__ import annotations

import difflib
import json
import numbers
import os
import tempfile
import urllib.parse
from collections import Counter

import attrs

from kvspec.harness.env import ConnectorAnswerError
from kvspec.spec.groups import NULL_BLOCK
from kvspec.spec.oracle import extend_prefix_keys, get_content


class ConnectorChoiceError(ValueError):
    """A malformed --connector or --connector-config (one line)."""


@attrs.frozen
class ConnectorChoice:
    """The connector a vllm target runs: a name vLLM registers, or
    ``module:Class`` of one installed beside kvspec, and its extra config."""

    name: str
    extra_config: str = ""  # JSON text of kv_connector_extra_config

    @property
    def class_name(self) -> str:
        return self.name.rpartition(":")[2]

    @property
    def module_path(self) -> str | None:
        return self.name.rpartition(":")[0] or None

    def get_extra_config(self) -> dict:
        return json.loads(self.extra_config) if self.extra_config else {}

    def to_query(self) -> str:
        """The target-name options that name this choice."""
        query = "connector=" + urllib.parse.quote(self.name, safe=":._")
        if self.extra_config:
            query += "&connector_config=" + urllib.parse.quote(self.extra_config, safe="")
        return query


def parse_choice(name: str, extra_config: str = "") -> ConnectorChoice:
    """``--connector NAME|module:Class [--connector-config JSON]``, checked."""
    name = urllib.parse.unquote(name).strip()
    module, _, cls = name.rpartition(":")
    if not cls.isidentifier() or (module and not all(p.isidentifier()
                                                     for p in module.split("."))):
        raise ConnectorChoiceError(f"--connector {name!r}: a connector name vLLM registers "
                                   "(e.g. ExampleConnector) or module.path:ClassName")
    text = urllib.parse.unquote(extra_config).strip()
    if text:
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConnectorChoiceError(f"--connector-config: not JSON ({exc.msg} at "
                                       f"character {exc.pos})") from None
        if not isinstance(parsed, dict):
            raise ConnectorChoiceError("--connector-config: a JSON object "
                                       "(kv_connector_extra_config), not "
                                       f"{type(parsed).__name__}")
        text = json.dumps(parsed, sort_keys=True, separators=(",", ":"))
    return ConnectorChoice(name, text)


def refuse_unregistered(choice: ConnectorChoice, source=None) -> None:
    """A bare name the checked vLLM's factory (``source``'s; None: the
    active one) does not register: one line naming the nearest registered
    ones, before vLLM is imported."""
    from kvspec.harness import vllm_source
    source = source or vllm_source.active()
    names = vllm_source.registered_connectors(source)
    if not names or choice.class_name in names:
        return  # an unreadable factory: vLLM's own lookup decides
    near = difflib.get_close_matches(choice.class_name, names, n=2, cutoff=0.5)
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    raise ConnectorChoiceError(
        f"--connector {choice.name}: vLLM {source.version} registers no connector of that "
        f"name; {hint}`kvspec targets` lists the {len(names)} it does (or give "
        "module.path:ClassName)")


def get_connector_class(choice: ConnectorChoice):
    """The connector class, as vLLM's factory would find it (imports vLLM and
    the connector's module)."""
    if not choice.module_path:
        refuse_unregistered(choice)
    from kvspec.harness.vllm_target import modules
    modules()  # the vLLM source this process checks, activated first
    if choice.module_path:
        import importlib
        module = importlib.import_module(choice.module_path)
        if not hasattr(module, choice.class_name):
            near = difflib.get_close_matches(choice.class_name, dir(module), n=1, cutoff=0.6)
            raise ConnectorChoiceError(
                f"--connector {choice.name}: {choice.module_path} has no {choice.class_name}"
                + (f"; did you mean {choice.module_path}:{near[0]}?" if near else ""))
        found = getattr(module, choice.class_name)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        if not (isinstance(found, type) and issubclass(found, KVConnectorBase_V1)):
            raise ConnectorChoiceError(f"{choice.name} is not a connector: --connector takes a "
                                       "subclass of vLLM's KVConnectorBase_V1")
        return found
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    return KVConnectorFactory.get_connector_class_by_name(choice.class_name)


def supports_hma(choice: ConnectorChoice) -> bool:
    """The connector declares support for several KV cache groups."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    supports = getattr(base, "SupportsHMA", None)
    return supports is not None and issubclass(get_connector_class(choice), supports)


#: in-tree connectors whose worker protocol kvspec does not play yet, and why:
#: with the generic world their scheduler side would wait for ever on
#: completions only their own worker metadata carries (a harness gap, never a
#: finding), or they take over the process. Every in-tree connector that
#: imports is played now (HF3FSKVConnector was the last)
NOT_PLAYED: dict[str, str] = {}


def is_generic_world(world) -> bool:
    """kvspec plays no world of its own around the connector (it derives from
    no in-tree one): it does not see its store or transfers."""
    return type(world) is GenericWorld


def _any_of(answers) -> bool | None:
    """True if one child does, False if none does, None if one may."""
    answers = list(answers)
    return True if True in answers else (None if None in answers else False)


def get_world(choice: ConnectorChoice):
    """The world kvspec plays around this connector: by the in-tree class it
    is or derives from (a copy with a change keeps its world). A connector
    whose worker protocol kvspec does not play is refused (one line)."""
    lineage = [c.__name__ for c in get_connector_class(choice).__mro__]
    unplayed = [name for name in lineage if name in NOT_PLAYED]
    if unplayed:
        raise ConnectorChoiceError(
            f"--connector {choice.name}: kvspec does not play {unplayed[0]}'s worker side yet: "
            f"{NOT_PLAYED[unplayed[0]]} (docs/connectors.md)")
    if "ExampleConnector" in lineage:
        return ExampleWorld()
    if "NixlBaseConnector" in lineage:
        return NixlWorld()
    if "OffloadingConnector" in lineage:
        return OffloadingWorld()
    if "MooncakeConnector" in lineage:
        return MooncakeWorld()
    if "SimpleCPUOffloadConnector" in lineage:
        return SimpleCPUOffloadWorld()
    if "MultiConnector" in lineage:
        return MultiWorld(choice.get_extra_config().get("connectors"))
    if "MooncakeStoreConnector" in lineage:
        return MooncakeStoreWorld()
    if "HF3FSKVConnector" in lineage:
        return HF3FSWorld()
    return GenericWorld()


def get_run(values: dict) -> int:
    """How many positions from the first a save holds without a gap."""
    n = 0
    while n in values:
        n += 1
    return n


def get_block_run(tokens, held, size: int, start: int = 0) -> int:
    """Where the run of whole blocks a store holds ends, counted from the
    block of ``start`` (the tokens before it are the local prefix cache's, and
    a lookup that skips them asks the store only for what follows: a store
    keyed by block hashes may have evicted an early block and kept later
    ones). ``held``: the token prefixes, each ending at a block's end, whose
    block the store holds. At least ``start``: nothing past it is held."""
    tokens, n = tuple(tokens), start // size * size
    while len(tokens) >= n + size and tokens[:n + size] in held:
        n += size
    return max(n, start)


def get_valid_values(tokens, num_tokens: int) -> dict:
    """The valid KV of the first ``num_tokens`` positions of a token sequence
    (what another instance that computed the prefix would have saved)."""
    keys: list = []
    extend_prefix_keys(keys, list(tokens), 0)
    return {p: get_content(0, keys, p) for p in range(num_tokens)}


#: what a connector kvspec plays no world for may define so that its hits are
#: judged against its store (``hit_within_stored``): ``kvspec_stored_end(request,
#: start)``, where the run of the request's tokens the store holds from position
#: ``start`` ends (``start`` or less when it holds none of them); docs/connectors.md
STORE_PROBE = "kvspec_stored_end"


def has_store_probe(connector) -> bool:
    """The connector (its class or an instance) defines ``STORE_PROBE``."""
    return callable(getattr(connector, STORE_PROBE, None))


class GenericWorld:
    """Any connector: the scheduler-side calls are all kvspec sees, and its
    store where the connector shows it (``STORE_PROBE``)."""

    #: the roles it runs in (kvspec's Config.kv_role), drawn per run
    roles: tuple[str, ...] = ("kv_both",)
    #: the world follows group 0's blocks only: one full-attention group
    single_group: bool = False
    #: the connector's worker reports failed loads (``invalid_block_ids`` or
    #: ``failed_recving``); where it never does, the environment draws none
    #: (a failure the real worker cannot report is not its scheduler's case)
    reports_load_failures: bool = True
    #: whether the connector ever answers an asynchronous load, and whether
    #: its ``request_finished`` ever delays a free (a send or save outliving
    #: the request); None: kvspec does not know (the run draws what it does)
    loads_async: bool | None = None
    delays_frees: bool | None = None

    #: its loads are read from the connector's metadata (not taken as the
    #: blocks ``update_state_after_alloc`` gave)
    takes_loads_from_meta: bool = False

    def get_transfer_args(self, spec, config) -> dict | None:
        """A request's ``extra_args`` (P/D ``kv_transfer_params``): none."""
        return None

    def configure(self, extra: dict, config) -> dict:
        """The connector's ``kv_connector_extra_config`` for a run of ``config``."""
        return extra

    def bind(self, connector, target) -> None:
        self.connector, self.target = connector, target

    def land_load(self, rid: str, values: dict, blocks, num_loaded: int,
                  num_unstored: int) -> None:
        """A load the world's worker ran: what it wrote (position -> value)
        joins the data oracle's load of ``rid``, and the contract judges it
        against the blocks the scheduler gave (``blocks``: the kvspec blocks
        it wrote, one group)."""
        env = self.target.env
        load = env.content.loads.get(rid)
        if load is not None:
            load.values = {**(load.values or {}), **values}
        env.record_load(rid, load.block_ids if load else (), (blocks,), num_loaded,
                        num_unstored)

    def seed(self, spec) -> None:
        """The outside world before the request arrives (nothing kvspec can set)."""

    def get_stored(self, request, start: int = 0) -> int | None:
        """How far the store holds the request's tokens from ``start`` (the
        lookup's local count): what the connector's ``STORE_PROBE`` says; None
        (not known, not judged) where it has none."""
        connector = getattr(self, "connector", None)
        if not has_store_probe(connector):
            return None
        probe = getattr(connector, STORE_PROBE)
        where = f"{STORE_PROBE}({request.request_id}, start={start})"
        try:
            end = probe(request, start)
        except Exception as exc:  # the connector's hook, not the scheduler, failed
            raise ConnectorAnswerError(f"{where} raised {type(exc).__name__}: {exc}") from None
        if not (is_int(end) and 0 <= end <= request.num_tokens):
            raise ConnectorAnswerError(
                f"{where} answered {end!r}, not an end position from 0 to "
                f"request.num_tokens ({request.num_tokens}) inclusive")
        # a stored prefix that ends before the lookup's start holds none of it
        return max(int(end), start)

    def on_meta(self, meta, scheduler_output) -> None:
        pass

    def before_output(self) -> None:
        pass

    def get_worker_meta(self, recving: set[str]):
        """``kv_connector_worker_meta`` of this output (None: the connector
        takes none), given the requests whose loads are reported finished."""
        return None

    def get_reads_in_flight(self, request) -> bool | None:
        return None

    def get_sends_done(self) -> set[str]:
        """Requests whose delayed free the worker reports in this output's
        ``finished_sending`` on its own (beside the sends the environment
        finishes: those of requests that hold blocks)."""
        return set()

    def on_finished(self, request, tables) -> None:
        """A request finished (``request_finished``): its blocks, kvspec ids."""

    def get_pins(self) -> list[int]:
        """vLLM block ids the connector holds a reference on (``touch``), one
        entry per reference: none."""
        return []

    def close(self) -> None:
        pass


class ExampleWorld(GenericWorld):
    """vLLM's ExampleConnector: a folder per saved prefix, saved and loaded
    synchronously by its worker. Its worker reports no load failure (a file
    it cannot read raises), so none is drawn. A save takes the slots its
    metadata names (the blocks the request's first step allocated) under the
    key of the whole block-aligned prompt; the folder holds what was read,
    which may be fewer positions than its key names."""

    reports_load_failures = False
    loads_async = False  # get_num_new_matched_tokens answers (n, False)
    delays_frees = False  # request_finished is the base class's: (False, None)
    takes_loads_from_meta = True

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvspec-example-connector-")
        #: folder -> (token ids saved, what each position held when saved)
        self.saved: dict[str, tuple[tuple[int, ...], dict]] = {}
        #: stores the step in flight asked for: (request id, folder, tokens, table)
        self.pending_stores: list = []

    def configure(self, extra: dict, config) -> dict:
        return {**extra, "shared_storage_path": self._dir.name}

    def close(self) -> None:
        self._dir.cleanup()

    def _folder(self, tokens) -> str:
        import torch
        return self.connector._generate_foldername_debug(
            torch.tensor(list(tokens), dtype=torch.long), [], create_folder=False)

    def _save(self, folder: str, tokens, values: dict) -> None:
        os.makedirs(folder, exist_ok=True)
        self.saved[folder] = (tuple(tokens), values)

    def seed(self, spec) -> None:
        """Another instance saved this prompt's prefix (``ext`` tokens) the
        way this connector does: whole blocks, short of the last token."""
        size = self.connector._block_size
        n = (len(spec.prompt) - 1) // size * size
        if spec.ext and n and spec.ext >= n:
            tokens = spec.prompt[:n]
            self._save(self._folder(tokens), tokens, get_valid_values(tokens, n))

    def get_stored(self, request, start: int = 0) -> int:
        """The longest prefix of the request's tokens a save holds, position by
        position from the first (a save keyed by a longer prefix than it holds
        counts what it holds)."""
        tokens = tuple(request.all_token_ids)
        return max((get_run(values) for t, values in self.saved.values()
                    if tokens[:len(t)] == t), default=0)

    def on_meta(self, meta, scheduler_output) -> None:
        """Each request the metadata names: a load (run by the worker in this
        step) or a store (saved when the step's output returns)."""
        for req in getattr(meta, "requests", ()):
            rid = self._request_of(req, scheduler_output)
            tokens = tuple(int(t) for t in req.token_ids.tolist())
            table = self._table(req)
            if req.is_store:
                self.pending_stores.append((rid, self._folder(tokens), tokens, table))
            elif rid is not None:
                self._load(rid, tokens, table)

    def _request_of(self, req, scheduler_output) -> str | None:
        """The request a ReqMeta is for (it carries no id): the scheduled one
        whose tokens start with its tokens and whose blocks hold its slots."""
        tokens = [int(t) for t in req.token_ids.tolist()]
        blocks = set(self._table(req))
        for rid in scheduler_output.num_scheduled_tokens:
            r = self.target.scheduler.requests.get(rid)
            if r is None or list(r.all_token_ids[:len(tokens)]) != tokens:
                continue
            held = {b for t in self.target.observe_request(rid).block_ids for b in t}
            if blocks <= held:
                return rid
        return None

    def _table(self, req) -> tuple[int, ...]:
        """kvspec block ids of the slots a ReqMeta names, one per block."""
        size = self.connector._block_size
        slots = [int(s) for s in req.slot_mapping.tolist()]
        vllm_ids = [slots[i] // size for i in range(0, len(slots), size)]
        return self.target._to_spec_ids(vllm_ids, 0)

    def _load(self, rid: str, tokens, table) -> None:
        saved = self._find_saved(tokens)
        values = saved[1] if saved else {}
        view = self.target.observe_request(rid)
        given = self.target.env.content.loads.pop(rid, None)  # the env's guess, replaced
        self.target.env.content.add_load(view, (table,), 0, len(tokens), False,
                                         {p: values.get(p) for p in range(len(tokens))})
        self.target.env.record_load(rid, given.block_ids if given else (), (table,),
                                    len(tokens), sum(p not in values for p in range(len(tokens))))

    def _find_saved(self, tokens):
        saved = self.saved.get(self._folder(tokens))
        return saved if saved and saved[0] == tuple(tokens) else None

    def before_output(self) -> None:
        """The step's stores, as the worker saved them during its forward."""
        content, env = self.target.env.content, self.target.env
        for rid, folder, tokens, table in self.pending_stores:
            values = content.read_stored(table, len(tokens))  # the slots it names only
            valid = get_valid_values(tokens, len(tokens))
            bad = tuple(p for p in sorted(values) if values[p] != valid[p])
            self._save(folder, tokens, values)
            env.record_store(rid or "?", len(values), bad)
        self.pending_stores = []


class NixlWorld(GenericWorld):
    """NIXL's P/D transfer (pull): on a decode node (kv_consumer) a request
    the environment plans with ``pd`` arrives with ``do_remote_prefill`` and
    the prefill node's blocks, and NIXL loads the whole prompt from there
    (async); on a prefill node (kv_producer) such a request arrives with
    ``do_remote_decode``, and when it finishes by its length cap or a stop
    the decode node pulls its blocks: NIXL must keep them until
    ``finished_sending``. Loads land or fail, sends finish, as the
    environment draws (NIXL's worker reports both in ``finished_recving`` /
    ``finished_sending``)."""

    roles = ("kv_consumer", "kv_producer")

    def get_transfer_args(self, spec, config) -> dict | None:
        if not spec.pd:
            return None
        if config.is_kv_consumer:
            size = self.target.config.scheduler_block_size
            params = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": "kvspec-prefill",
                      "remote_request_id": spec.request_id,
                      "remote_block_ids": list(range(-(-len(spec.prompt) // size))),
                      "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}
        else:
            params = {"do_remote_decode": True, "do_remote_prefill": False}
        return {"kv_transfer_params": params}

    #: the finishing statuses after which the decode node pulls (NIXL delays
    #: the free for both, and hands its transfer parameters over)
    pulled_after = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")

    def get_pulls(self, meta):
        """request id -> the local block ids (per group) its pull writes."""
        return {rid: req.local_block_ids for rid, req in getattr(meta, "reqs_to_recv", {}).items()}

    def on_meta(self, meta, scheduler_output) -> None:
        """The blocks each pull writes (the request's blocks not found in the
        local prefix cache) against those the scheduler gave."""
        env = self.target.env
        for rid, groups in self.get_pulls(meta).items():
            job = env.content.loads.get(rid)
            if job is None:
                continue  # a recv with nothing to load (a full local hit frees P's blocks)
            env.record_load(rid, job.block_ids, self.target.get_spec_tables(groups))

    def get_stored(self, request, start: int = 0) -> int | None:
        """A decode node's remote prefill holds the whole prompt; nothing else
        is stored anywhere NIXL looks."""
        plan = self.target.env.plans.get(request.request_id)
        remote = plan is not None and plan.pd and self.target.config.is_kv_consumer
        return len(request.prompt_token_ids) if remote else 0

    def get_reads_in_flight(self, request) -> bool | None:
        """On a prefill node the decode node pulls a ``do_remote_decode``
        request's blocks once it finished by its length cap or a stop (an
        abort hands nothing over)."""
        if not self.target.config.is_kv_producer:
            return False
        plan = self.target.env.plans.get(request.request_id)
        ended = {self.target.m.VStatus[name] for name in self.pulled_after}
        return bool(plan is not None and plan.pd and request.status in ended)


class MooncakeWorld(NixlWorld):
    """Mooncake's P/D transfer (pull), as NIXL's with Mooncake's parameters:
    a decode node's request names the prefill node's engine, bootstrap address
    and transfer id; a prefill node hands over (and must keep until
    ``finished_sending``) the blocks of a request that hit its length cap,
    the one way a prefill request (``max_tokens=1``) ends before the router
    sends it to decode; one that stopped at EOS is not sent on."""

    pulled_after = ("FINISHED_LENGTH_CAPPED",)

    def get_transfer_args(self, spec, config) -> dict | None:
        if not spec.pd:
            return None
        if config.is_kv_consumer:
            params = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": "kvspec-prefill",
                      "remote_bootstrap_addr": "127.0.0.1:1", "transfer_id": spec.request_id}
        else:
            params = {"do_remote_decode": True, "do_remote_prefill": False,
                      "transfer_id": spec.request_id}
        return {"kv_transfer_params": params}

    def get_pulls(self, meta):
        """``reqs_to_recv`` is keyed by the remote engine, then the request."""
        return {rid: req.local_block_ids for by_engine in getattr(meta, "reqs_to_recv", {}).values()
                for rid, req in by_engine.items()}


@attrs.define
class OffloadStore:
    """A store job of the OffloadingConnector in kvspec's worker: which GPU
    blocks it reads, which positions of its request they hold, and which
    CPU chunks it writes."""

    job_id: int
    request_id: str
    gpu_blocks: tuple[int, ...]
    chunks: tuple[int, ...]
    #: the position of each GPU block's first slot in its request
    starts: tuple[int, ...]
    tokens: tuple[int, ...]
    #: positions the scheduler has computed by the step that made the job
    computed: int
    age: int = 0


class OffloadingWorld(GenericWorld):
    """vLLM's OffloadingConnector with its CPU backend (one CPU chunk per GPU
    block). kvspec's worker runs the jobs its metadata names: a store job
    reads its GPU blocks when it completes, one step after the step that
    computed them (the real worker submits it at the next step's start and
    copies in the background), unless ``jobs_to_flush`` names it first (then
    before that step's forward); a load job writes what the CPU chunks hold
    and completes with its request's load, as the environment draws. Both
    report ``OffloadingWorkerMetadata.completed_jobs``. A store that reads a
    block after the scheduler reused it (a fence the connector did not ask
    for) saves another request's KV: ``store_reads_computed_kv``."""

    single_group = True
    #: its worker asserts every transfer succeeds (offloading/worker.py: job
    #: failures are not supported)
    reports_load_failures = False

    def __init__(self) -> None:
        #: CPU chunk -> the slot values a completed store saved there
        self.chunks: dict[int, list] = {}
        self.stores: list[OffloadStore] = []
        #: request id -> its load jobs, completed with its load
        self.load_jobs: dict[str, list[int]] = {}
        self.completed: set[int] = set()
        #: token prefixes, up to a block's end, whose block a store saved
        self.saved_prefixes: set[tuple[int, ...]] = set()

    def configure(self, extra: dict, config) -> dict:
        """A CPU cache of 4 MiB (eviction is rare in kvspec's runs); one CPU
        chunk per GPU block, which the world's position mapping needs."""
        if extra.get("block_size") not in (None, config.block_size) or \
                extra.get("blocks_per_chunk") not in (None, 1):
            raise ConnectorChoiceError("--connector-config: kvspec plays the offloading "
                                       "connector with one CPU chunk per GPU block (no "
                                       "block_size or blocks_per_chunk)")
        return {"cpu_bytes_to_use": 1 << 22, **extra}

    def _size(self) -> int:
        return self.target.config.block_size

    def _starts(self, spec, rid: str | None = None) -> tuple[int, ...]:
        """Where each GPU block of a spec starts in its request: by its place
        in the request's table while the request holds it (a store job may
        skip chunks already stored), else counted from ``block_indices[0]``
        (a load's blocks are contiguous)."""
        gpu = self._gpu(spec)
        table = ()
        if rid is not None and rid in self.target.scheduler.requests:
            table = self.target.observe_request(rid).block_ids[0]
        if all(b in table for b in gpu):
            return tuple(table.index(b) * self._size() for b in gpu)
        first = int(spec.block_indices[0])
        return tuple((first + i) * self._size() for i in range(len(gpu)))

    def _gpu(self, spec) -> tuple[int, ...]:
        ids = [int(b) for b in spec.block_ids][:int(spec.group_sizes[0])]
        return self.target._to_spec_ids(ids, 0)

    def on_meta(self, meta, scheduler_output) -> None:
        for jid, job in getattr(meta, "load_jobs", {}).items():
            self._start_load(jid, job)
        for jid, job in getattr(meta, "store_jobs", {}).items():
            gpu, chunks = self._gpu(job.src_spec), tuple(int(c) for c in job.dst_spec.block_ids)
            request = self.target._requests[job.req_id]  # kept after it finished
            # the metadata is built before the scheduler advances the count:
            # this step's positions are computed by the time the store runs
            computed = (request.num_computed_tokens
                        + scheduler_output.num_scheduled_tokens.get(job.req_id, 0))
            self.stores.append(OffloadStore(jid, job.req_id, gpu, chunks,
                                            self._starts(job.src_spec, job.req_id),
                                            tuple(request.all_token_ids), computed))
        flush = set(getattr(meta, "jobs_to_flush", None) or ())
        for store in [s for s in self.stores if s.job_id in flush]:
            self._complete_store(store)

    def _start_load(self, jid: int, job) -> None:
        rid = job.req_id
        gpu, chunks = self._gpu(job.dst_spec), [int(c) for c in job.src_spec.block_ids]
        values, unstored = {}, 0
        for start, chunk in zip(self._starts(job.dst_spec), chunks):
            slots = self.chunks.get(chunk)
            unstored += slots is None
            values.update({start + s: v for s, v in enumerate(slots or ())})
        self.land_load(rid, values, gpu, len(gpu) * self._size(), unstored * self._size())
        self.load_jobs.setdefault(rid, []).append(jid)

    def _complete_store(self, store: OffloadStore) -> None:
        content, env = self.target.env.content, self.target.env
        size = self._size()
        valid = get_valid_values(store.tokens, len(store.tokens))
        bad = []
        for block, chunk, start in zip(store.gpu_blocks, store.chunks, store.starts):
            slots = list(content.slots[block][:size])
            self.chunks[chunk] = slots
            self.saved_prefixes.add(store.tokens[:start + size])
            bad += [start + s for s, v in enumerate(slots)
                    if start + s < min(store.computed, len(store.tokens))
                    and v != valid[start + s]]
        self.stores.remove(store)
        self.completed.add(store.job_id)
        env.record_store(store.request_id, len(store.gpu_blocks) * size, tuple(bad))

    def get_stored(self, request, start: int = 0) -> int:
        """Where the run of whole blocks some store saved ends, from the block
        of ``start`` (an upper bound: the CPU cache may have evicted since)."""
        return get_block_run(request.all_token_ids, self.saved_prefixes, self._size(), start)

    def before_output(self) -> None:
        """Stores submitted a step ago complete now; the rest age."""
        for store in list(self.stores):
            if store.age >= 1:
                self._complete_store(store)
            else:
                store.age += 1

    def get_worker_meta(self, recving: set[str]):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata)
        for rid in recving:
            self.completed.update(self.load_jobs.pop(rid, ()))
        meta = OffloadingWorkerMetadata()
        for jid in sorted(self.completed):
            meta.mark_completed(jid)
        self.completed.clear()
        return meta


class BlockOwners:
    """Which request position each GPU block (kvspec id, group 0) holds, as
    last seen: refreshed from the live requests' tables after each step's
    metadata was read, and from a finishing request's table. A store emitted
    for a block is judged against the owner recorded before the step that
    emitted it (a block the scheduler reused in that step, unfenced, holds
    another request's KV: ``store_reads_computed_kv``)."""

    def __init__(self, target) -> None:
        self.target = target
        #: block -> (request id, position of its first slot)
        self.owner: dict[int, tuple[str, int]] = {}

    def note_table(self, rid: str, table) -> None:
        size = self.target.config.block_size
        for i, b in enumerate(table):
            if b != NULL_BLOCK:
                self.owner[b] = (rid, i * size)

    def refresh(self) -> None:
        for rid in self.target.scheduler.requests:
            self.note_table(rid, self.target.observe_request(rid).block_ids[0])

    def get_bad(self, block: int, slots, computed_of) -> tuple[int, list[int]] | None:
        """(request, bad positions) of a store reading ``slots`` from
        ``block``: the computed positions it holds that are not their valid KV.
        None: no request ever held the block (nothing to judge)."""
        if block not in self.owner:
            return None
        rid, start = self.owner[block]
        request = self.target._requests[rid]  # kept after it finished
        tokens = tuple(request.all_token_ids)
        valid = get_valid_values(tokens, len(tokens))
        upto = min(computed_of(rid), len(tokens))
        return rid, [start + s for s, v in enumerate(slots)
                     if start + s < upto and v != valid[start + s]]


@attrs.define
class CPUStore:
    """A store event of the SimpleCPUOffloadConnector: GPU blocks copied to
    CPU blocks, read when its step's forward is done, completed later."""

    event: int
    pairs: tuple[tuple[int, int], ...]  # (GPU block, CPU block), kvspec GPU ids
    age: int = 0


class SimpleCPUOffloadWorld(GenericWorld):
    """vLLM's SimpleCPUOffloadConnector (eager mode, CPU backend). Its
    scheduler hands the worker one load event and one store event per step
    (``SimpleCPUOffloadMetadata``: flat GPU and CPU block lists,
    v1/simple_kv_offload/metadata.py:15). kvspec's worker plays
    v1/simple_kv_offload/worker.py: a store (``wait_for_save``, :280) copies
    its GPU blocks after the step's forward, so it reads them when the step's
    output returns, and completes one step later, or at once when
    ``need_flush`` (a preemption, ``handle_preemptions`` :345) syncs every
    transfer; it reports ``SimpleCPUOffloadWorkerMetadata.completed_store_events``
    (:320). A load writes what its CPU blocks hold into the GPU blocks the
    metadata names and completes by ``finished_recving`` (``get_finished``
    :300), as the environment draws. The scheduler pins the blocks a store
    reads (manager.py:1223, ``touch``) instead of delaying a free, so a finish
    has no reads kvspec's world can see in flight. The world follows group
    0's blocks only: one full-attention group (the connector supports HMA;
    kvspec does not model its hybrid CPU pool)."""

    single_group = True
    #: its worker reports no failed transfer (worker.py: events only complete)
    reports_load_failures = False

    def __init__(self) -> None:
        #: CPU block -> (the token prefix up to its block's end, its slot values)
        self.cpu: dict[int, tuple[tuple[int, ...], list]] = {}
        self.stores: list[CPUStore] = []
        self.completed: set[int] = set()
        #: live request -> positions computed by the step in flight
        self.computed_at: dict[str, int] = {}

    def configure(self, extra: dict, config) -> dict:
        """A CPU pool of twice the GPU blocks (the manager scales the pool by
        ``cpu_bytes_to_use`` over the GPU allocation, manager.py:288): LRU
        eviction happens, rarely. Eager stores on the CPU backend only."""
        if extra.get("lazy_offload") or extra.get("kv_offload_backend", "cpu") != "cpu":
            raise ConnectorChoiceError("--connector-config: kvspec plays SimpleCPUOffload"
                                       "Connector's eager stores to CPU (no lazy_offload, "
                                       "no disk backend)")
        page = 2 * config.block_size * 8 * 4  # K and V, one head of 8 float32 (vllm_target)
        return {"cpu_bytes_to_use": page * len(config.groups) * 2 * (config.num_blocks + 1),
                **extra}

    def bind(self, connector, target) -> None:
        super().bind(connector, target)
        self.owners = BlockOwners(target)

    def _size(self) -> int:
        return self.target.config.block_size

    def _gpu(self, vllm_ids) -> tuple[int, ...]:
        return self.target._to_spec_ids([int(b) for b in vllm_ids], 0)

    def on_meta(self, meta, scheduler_output) -> None:
        if meta.need_flush:
            # handle_preemptions (worker.py:345) syncs the transfers already in
            # flight before the forward; this step's store is launched after
            # it (wait_for_save), so it still reads at the step's end
            for store in self.stores:
                store.age = max(store.age, 1)
        if meta.store_event >= 0:
            pairs = tuple(zip(self._gpu(meta.store_gpu_blocks),
                              (int(c) for c in meta.store_cpu_blocks)))
            self.stores.append(CPUStore(meta.store_event, pairs))
        # the metadata is built before the scheduler advances the counts: this
        # step's positions are computed by the time its stores read
        self.computed_at = {rid: r.num_computed_tokens
                            + scheduler_output.num_scheduled_tokens.get(rid, 0)
                            for rid, r in self.target.scheduler.requests.items()}
        if meta.load_event >= 0:
            self._start_loads(meta)
        self.owners.refresh()

    def _start_loads(self, meta) -> None:
        """The event's loads, one per request it names: the GPU blocks of the
        flat list the request holds, in its table's order."""
        gpu = self._gpu(meta.load_gpu_blocks)
        cpu = [int(c) for c in meta.load_cpu_blocks]
        for rid in meta.load_event_to_reqs.get(meta.load_event, ()):
            table = self.target.observe_request(rid).block_ids[0]
            pairs = [(g, c) for g, c in zip(gpu, cpu) if g in table]
            self._load(rid, table, pairs)

    def _load(self, rid: str, table, pairs) -> None:
        size = self._size()
        values, unstored = {}, 0
        for g, c in pairs:
            held = self.cpu.get(c)
            unstored += held is None
            start = table.index(g) * size
            values.update({start + s: v for s, v in enumerate(held[1] if held else ())})
        self.land_load(rid, values, [g for g, _ in pairs], len(pairs) * size, unstored * size)

    def on_finished(self, request, tables) -> None:
        self.owners.note_table(request.request_id, tables[0] if tables else ())

    def _computed(self, rid: str) -> int:
        """Positions of a request computed by the store's step (a finished
        request's final count)."""
        return self.computed_at.get(rid, self.target._requests[rid].num_computed_tokens)

    def before_output(self) -> None:
        """Stores launched this step read their blocks now (after the
        forward); those launched a step ago (or flushed) complete."""
        for store in list(self.stores):
            if store.age == 0:
                self._read(store)
            if store.age >= 1:
                self.stores.remove(store)
                self.completed.add(store.event)
            store.age += 1

    def _read(self, store: CPUStore) -> None:
        content, env, size = self.target.env.content, self.target.env, self._size()
        by_request: dict[str, list[int]] = {}
        for g, c in store.pairs:
            slots = list(content.slots[g][:size])
            judged = self.owners.get_bad(g, slots, self._computed)
            rid, bad = judged if judged else ("?", [])
            tokens = tuple(self.target._requests[rid].all_token_ids) if judged else ()
            start = self.owners.owner[g][1] if judged else 0
            self.cpu[c] = (tokens[:start + size], slots)
            by_request.setdefault(rid, []).extend(bad)
        for rid, bad in by_request.items():
            n = sum(1 for g, _ in store.pairs
                    if self.owners.owner.get(g, ("?",))[0] == rid) * size
            env.record_store(rid, n, tuple(sorted(bad)))

    def get_stored(self, request, start: int = 0) -> int:
        """Where the run of whole blocks some CPU block holds ends, from the
        block of ``start``: the manager's lookup skips the local hit
        (manager.py:367) and its LRU may evict an early block and keep later
        ones (a CPU block a later store reused holds the later one)."""
        held = {prefix for prefix, _ in self.cpu.values()}
        return get_block_run(request.all_token_ids, held, self._size(), start)

    def get_pins(self) -> list[int]:
        """The GPU blocks the manager touched and has not freed yet, from its
        books (v1/simple_kv_offload/manager.py): loads from
        ``update_state_after_alloc`` (:499) to their cleanup (:1320), stores
        from their emission (or a finished request's queueing, :1254) to their
        completion. kvspec cannot see a pin otherwise; ``ref_count_is_holders``
        then judges that the pool's counts match the books."""
        m = getattr(self.connector, "scheduler_manager", None)
        if m is None:
            return []
        transfers = [*m._store_event_to_blocks.values(), *m._pending_finished_stores,
                     *m._abandoned_store_event_to_blocks.values(),
                     *(s.transfer_meta for s in (*m._reqs_to_load.values(),
                                                 *m._abandoned_reqs_to_load.values())
                       if s.transfer_meta is not None)]
        return [b for t in transfers for b in t.gpu_block_ids]

    def get_worker_meta(self, recving: set[str]):
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
        if not self.completed:
            return None
        meta = SimpleCPUOffloadWorkerMetadata(
            completed_store_events={e: 1 for e in sorted(self.completed)})
        self.completed.clear()
        return meta


class StoreLookup:
    """The scheduler's ``LookupKeyClient`` (mooncake/store/worker.py:2380)
    answered from kvspec's store instead of a zmq socket to the worker's
    LookupKeyServer, as vLLM's test_mooncake_store_scheduler.py patches it.
    The hit mirrors ``MooncakeStoreWorker.lookup`` (worker.py:2095) for one
    full-attention group: the run of block hashes from the first that the
    store holds, whole blocks within the request's tokens, re-derived below
    the last token when it covers them all (:2193)."""

    def __init__(self, world: "MooncakeStoreWorld") -> None:
        self.world = world

    def lookup(self, req_id, num_tokens, block_hashes, non_block=False):
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeLookupResult)
        hit = self._hit(block_hashes, num_tokens)
        if hit >= num_tokens:
            hit = self._hit(block_hashes, num_tokens - 1)
        return MooncakeLookupResult(hit)

    def _hit(self, block_hashes, num_tokens: int) -> int:
        size, n = self.world._size(), 0
        while (n + 1) * size <= num_tokens and n < len(block_hashes) \
                and bytes(block_hashes[n]) in self.world.saved:
            n += 1
        return n * size

    def discard(self, req_id) -> None:
        pass

    def reset(self) -> bool:
        self.world.saved.clear()
        return True

    def close(self) -> None:
        pass


@attrs.define
class StoreSave:
    """A save job of the MooncakeStoreConnector: blocks of one request, from
    the first position not saved yet, read when its step's forward is done."""

    job_id: int | None
    request_id: str
    #: (block hash, kvspec GPU block, position of its first slot)
    blocks: tuple[tuple[bytes, int, int], ...]
    computed: int
    age: int = 0


class MooncakeStoreWorld(GenericWorld):
    """vLLM's MooncakeStoreConnector with kvspec's store in place of the
    Mooncake master: a key per block hash (the request's ``block_hashes``).
    Its lookup client is ``StoreLookup``. kvspec's worker plays
    mooncake/store/worker.py: a ``ReqMeta`` that ``can_save`` saves its
    request's whole blocks from ``token_ids_start`` to ``token_len_chunk``
    under their hashes (a key already held is kept), reading them when the
    step's output returns, and completes one step later through
    ``MooncakeStoreWorkerMetadata.completed_saves`` (data.py:869); a
    ``ReqMeta`` with a ``load_spec`` loads positions ``vllm_cached_tokens``
    to ``kvpool_cached_tokens`` into its ``block_ids`` from the keys, and
    completes by finished_recving (``load_async``, the default) as the
    environment draws. Save jobs pin their blocks (scheduler.py:540) until
    reported. One full-attention group (the world follows group 0)."""

    single_group = True
    #: its worker's failed loads are reported by block; kvspec does not draw them
    reports_load_failures = False

    def __init__(self) -> None:
        #: block hash -> (the token prefix up to its block's end, its slot values)
        self.saved: dict[bytes, tuple[tuple[int, ...], list]] = {}
        self.saves: list[StoreSave] = []
        self.completed: set[int] = set()

    def configure(self, extra: dict, config) -> dict:
        """The scheduler's lookup client answers from this world's store."""
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import scheduler
        scheduler.LookupKeyClient = lambda vllm_config: StoreLookup(self)
        if extra.get("load_async") is False or extra.get("lookup_async"):
            raise ConnectorChoiceError("--connector-config: kvspec plays MooncakeStore"
                                       "Connector's async loads and blocking lookups")
        return extra

    def _size(self) -> int:
        return self.target.config.block_size

    def on_meta(self, meta, scheduler_output) -> None:
        for req in getattr(meta, "requests", ()):
            table = self.target._to_spec_ids([int(b) for b in req.block_ids[0]], 0)
            if req.load_spec is not None and req.load_spec.can_load:
                self._load(req, table)
            if req.can_save and req.token_len_chunk:
                self._start_save(req, table, scheduler_output)

    def _load(self, req, table) -> None:
        size = self._size()
        start, end = req.load_spec.vllm_cached_tokens, req.load_spec.kvpool_cached_tokens
        values, unstored, blocks = {}, 0, []
        for i in range(start // size, -(-end // size)):
            held = self.saved.get(bytes(req.block_hashes[i])) if i < len(req.block_hashes) \
                else None
            unstored += held is None
            blocks.append(table[i])
            values.update({i * size + s: v for s, v in enumerate(held[1] if held else ())})
        self.land_load(req.req_id, values, blocks, end - start, unstored * size)

    def _start_save(self, req, table, scheduler_output) -> None:
        size = self._size()
        request = self.target._requests[req.req_id]
        computed = (request.num_computed_tokens
                    + scheduler_output.num_scheduled_tokens.get(req.req_id, 0))
        first = req.token_ids_start // size
        blocks = tuple((bytes(req.block_hashes[i]), table[i], i * size)
                       # a block whose tokens are not all known yet (async
                       # scheduling's placeholders) has no hash: no key to save
                       for i in range(first, min(req.token_len_chunk // size,
                                                 len(req.block_hashes))))
        self.saves.append(StoreSave(req.store_job_id, req.req_id, blocks, computed))

    def before_output(self) -> None:
        for save in list(self.saves):
            if save.age == 0:
                self._read(save)
            if save.age >= 1:
                self.saves.remove(save)
                if save.job_id is not None:
                    self.completed.add(save.job_id)
            save.age += 1

    def _read(self, save: StoreSave) -> None:
        content, size = self.target.env.content, self._size()
        tokens = tuple(self.target._requests[save.request_id].all_token_ids)
        valid = get_valid_values(tokens, len(tokens))
        upto, bad = min(save.computed, len(tokens)), []
        for key, block, start in save.blocks:
            slots = list(content.slots[block][:size])
            bad += [start + s for s, v in enumerate(slots) if start + s < upto
                    and v != valid[start + s]]
            self.saved.setdefault(key, (tokens[:start + size], slots))
        self.target.env.record_store(save.request_id, len(save.blocks) * size, tuple(bad))

    def get_stored(self, request, start: int = 0) -> int:
        """Where the run of whole blocks whose keys the store holds ends,
        from the block of ``start``."""
        held = {prefix for prefix, _ in self.saved.values()}
        return get_block_run(request.all_token_ids, held, self._size(), start)

    def get_pins(self) -> list[int]:
        """The blocks its save jobs pin (``_pinned_saves``, scheduler.py:575),
        from its books, until every rank reported the job."""
        pinned = getattr(getattr(self.connector, "connector_scheduler", None),
                         "_pinned_saves", {})
        return [b for block_ids, _ in pinned.values() for b in block_ids]

    def get_worker_meta(self, recving: set[str]):
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeStoreWorkerMetadata)
        if not self.completed:
            return None
        meta = MooncakeStoreWorkerMetadata(completed_saves={j: 1 for j in sorted(self.completed)})
        self.completed.clear()
        return meta


class MultiWorld(GenericWorld):
    """vLLM's MultiConnector: the worlds of its children, side by side
    (multi_connector.py). Each child's world reads the child's slot of
    ``MultiKVConnectorMetadata.metadata`` and plays its worker; their worker
    metadata travel together in ``MultiKVConnectorWorkerMetadata`` (one slot
    per child, :55; ``update_connector_output`` hands each child its own,
    :496). Loads and finished_recving are per request, whichever child won
    the lookup (the first with a hit, :434). A finished request delays its
    free if any child does (:542); the worker reports it in finished_sending
    once, after every delaying child finished (``extra_async_saves``,
    :358): the environment reports each send once, which is that.

    Without ``connectors`` in --connector-config the children are
    OffloadingConnector then SimpleCPUOffloadConnector (two CPU stores, each
    saving every request, the first with a hit loading it); ExampleConnector
    is left out of the default as its own store breaks
    ``store_reads_computed_kv`` (it saves a prompt at its first chunk,
    docs/connectors.md), which would stop every default run on it. A config
    naming ``connectors`` picks any children kvspec has a world for, with
    their own extra config."""

    DEFAULT_CHILDREN = ({"kv_connector": "OffloadingConnector"},
                        {"kv_connector": "SimpleCPUOffloadConnector"})

    def __init__(self, connectors: list[dict] | None = None) -> None:
        """``connectors``: the children of --connector-config (None: the
        default pair); their worlds are known from the start, so the
        environment's profile reads them without configuring anything."""
        self.specs = list(connectors or self.DEFAULT_CHILDREN)
        self.children: list[GenericWorld] = [self._get_child_world(c) for c in self.specs]

    @staticmethod
    def _get_child_world(child: dict) -> GenericWorld:
        name = child.get("kv_connector")
        if not name:
            raise ConnectorChoiceError("--connector-config: each of connectors names its "
                                       "kv_connector")
        world = get_world(ConnectorChoice(name if not child.get("kv_connector_module_path")
                                          else f"{child['kv_connector_module_path']}:{name}"))
        if isinstance(world, MultiWorld):
            raise ConnectorChoiceError("--connector-config: a MultiConnector in a "
                                       "MultiConnector")
        return world

    def configure(self, extra: dict, config) -> dict:
        children = [{**child, "kv_role": child.get("kv_role", config.kv_role),
                     "kv_connector_extra_config": world.configure(
                         child.get("kv_connector_extra_config", {}), config)}
                    for child, world in zip(self.specs, self.children)]
        return {**extra, "connectors": children}

    @property
    def single_group(self) -> bool:
        return any(w.single_group for w in self.children)

    @property
    def reports_load_failures(self) -> bool:
        return all(w.reports_load_failures for w in self.children)

    @property
    def loads_async(self) -> bool | None:
        return _any_of(w.loads_async for w in self.children)

    @property
    def delays_frees(self) -> bool | None:
        return _any_of(w.delays_frees for w in self.children)

    @property
    def roles(self) -> tuple[str, ...]:
        common = set.intersection(*(set(w.roles) for w in self.children))
        return tuple(r for r in self.children[0].roles if r in common) or ("kv_both",)

    def bind(self, connector, target) -> None:
        super().bind(connector, target)
        for world, child in zip(self.children, connector._connectors):
            world.bind(child, target)

    def get_transfer_args(self, spec, config) -> dict | None:
        args = [w.get_transfer_args(spec, config) for w in self.children]
        return next((a for a in args if a), None)

    def seed(self, spec) -> None:
        for w in self.children:
            w.seed(spec)

    def get_stored(self, request, start: int = 0) -> int | None:
        """What any child's store holds (the hit is the first child's with one)."""
        stored = [w.get_stored(request, start) for w in self.children]
        return None if None in stored else max(stored)

    def on_meta(self, meta, scheduler_output) -> None:
        for world, child_meta in zip(self.children, meta.metadata):
            world.on_meta(child_meta, scheduler_output)

    def before_output(self) -> None:
        for w in self.children:
            w.before_output()

    def get_worker_meta(self, recving: set[str]):
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
            MultiKVConnectorWorkerMetadata)
        metas = tuple(w.get_worker_meta(recving) for w in self.children)
        if all(m is None for m in metas):
            return None
        return MultiKVConnectorWorkerMetadata(metadata=metas)

    def get_reads_in_flight(self, request) -> bool | None:
        reads = [w.get_reads_in_flight(request) for w in self.children]
        return True if True in reads else (None if None in reads else False)

    def get_sends_done(self) -> set[str]:
        return set().union(*(w.get_sends_done() for w in self.children))

    def on_finished(self, request, tables) -> None:
        for w in self.children:
            w.on_finished(request, tables)

    def get_pins(self) -> list[int]:
        return [b for w in self.children for b in w.get_pins()]

    def close(self) -> None:
        for w in self.children:
            w.close()


class _Ignored:
    """A module's ``signal`` or ``atexit`` as the HF3FS connector sees them:
    handlers and exit hooks it registers are dropped (the rest is the real
    module's)."""

    def __init__(self, module, *dropped: str) -> None:
        self._module, self._dropped = module, dropped

    def __getattr__(self, name):
        if name in self._dropped:
            return lambda *args, **kwargs: None
        return getattr(self._module, name)


class Hf3fsMetadata:
    """The HF3FS metadata server in-process: its own ``GlobalMetadataState``
    (hf3fs_metadata_server.py), which the scheduler's client asks (in place of
    ``Hf3fsGlobalMetadataClient``'s HTTP calls) and kvspec's worker allocates
    and confirms pages in."""

    def __init__(self, world: "HF3FSWorld") -> None:
        self.state = world.meta

    def initialize(self, rank: int, num_pages: int = 0, role: str = "worker") -> None:
        if role == "worker":
            self.state.initialize_rank(rank, num_pages)

    def allocate_pages_for_keys(self, rank: int, keys):
        return list(self.state.allocate_pages_for_keys(rank, keys).items())

    def confirm_write_for_keys(self, rank: int, key_confirmations, pages_to_release=None):
        self.state.confirm_write_for_keys(rank, key_confirmations, pages_to_release)

    def batch_key_exists(self, keys) -> list[bool]:
        return self.state.batch_key_exists(keys)

    def get_key_locations(self, rank: int, keys):
        return self.state.get_key_locations(rank, keys)


@attrs.define
class Hf3fsSave:
    """A save the HF3FS worker submits in ``wait_for_save``: blocks of one
    request under the prefix hashes of its metadata's token ids."""

    request_id: str
    #: (block hash, kvspec GPU block, the token prefix up to its block's end)
    blocks: tuple[tuple[str, int, tuple[int, ...]], ...]


class HF3FSWorld(GenericWorld):
    """vLLM's HF3FSKVConnector (hf3fs/hf3fs_connector.py) with kvspec's
    store in place of 3FS and its metadata server in-process
    (``Hf3fsMetadata``: the server's own ``GlobalMetadataState``, one rank).
    Its construction's SIGINT/SIGTERM/SIGQUIT handlers and atexit hook are
    dropped (kvspec's own handlers stop a run; the scheduler side's
    ``close`` has nothing to close). kvspec's worker plays its
    ``AsyncOperationManager``: a ``HF3FSRequestMetadata`` with a
    ``load_block_op`` loads ``block_ids[:num_blocks_to_load]`` from the pages
    its prefix hashes name (from ``num_computed_blocks``), the whole load
    failing if one key is missing (``_handle_load_task``; the worker then
    reports it finished all the same), and finishes by ``finished_recving``
    as the environment draws; one with a ``save_block_op`` saves its whole
    blocks from ``skip_leading_blocks`` under their hashes (``wait_for_save``:
    gathered after the step's forward, so read when the step's output
    returns; pages allocated and confirmed then, a key already written keeping
    its page). ``request_finished`` always delays the free: a request holding
    blocks is sent as the environment draws; one holding none the worker
    reports at once (``_check_completed_saves`` finds no save of it in the
    step that names it finished). One full-attention group (it takes
    ``get_unhashed_block_ids``)."""

    single_group = True
    #: a failed load task completes its future all the same: the worker never
    #: reports a failed load
    reports_load_failures = False
    #: pages of the in-process 3FS file (never evicted: the metadata server
    #: frees a page only when its write fails)
    NUM_PAGES = 1 << 16

    def __init__(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.hf3fs.hf3fs_metadata_server import (
            GlobalMetadataState)
        self.meta = GlobalMetadataState()
        self.meta.initialize_rank(0, self.NUM_PAGES)
        #: page -> (the token prefix up to its block's end, its slot values)
        self.pages: dict[int, tuple[tuple[int, ...], list]] = {}
        #: per step in flight (oldest first): its saves, and the requests
        #: without blocks its metadata names finished
        self.steps: list[tuple[list[Hf3fsSave], set[str]]] = []
        self.blockless: set[str] = set()
        self.sends_done: set[str] = set()

    def configure(self, extra: dict, config) -> dict:
        """The scheduler's metadata client is ``Hf3fsMetadata``; its
        construction registers no signal handler or exit hook."""
        import atexit
        import signal
        from vllm.distributed.kv_transfer.kv_connector.v1.hf3fs import hf3fs_connector
        hf3fs_connector.Hf3fsMetadataClient = lambda *a, **k: Hf3fsMetadata(self)
        hf3fs_connector.signal = _Ignored(signal, "signal")
        hf3fs_connector.atexit = _Ignored(atexit, "register")
        return extra

    def _size(self) -> int:
        return self.target.config.block_size

    def _hashes(self, tokens, first: int, count: int | None = None) -> list[str]:
        return self.connector._generate_block_hashes(list(tokens), first, count)

    def seed(self, spec) -> None:
        """Another instance saved this prompt's prefix (``ext`` tokens, whole
        blocks) the way its worker does."""
        size = self._size()
        n = spec.ext // size
        if n:
            tokens = tuple(spec.prompt[:n * size])
            valid = get_valid_values(tokens, len(tokens))
            self._write([(h, tokens[:(i + 1) * size], [valid[i * size + s] for s in range(size)])
                         for i, h in enumerate(self._hashes(tokens, 0))])

    def _write(self, blocks) -> None:
        """Pages allocated, written and confirmed (``_handle_save_task``)."""
        keys = [(h, "") for h, _, _ in blocks]
        pages = self.meta.allocate_pages_for_keys(0, keys)
        written = []
        for h, prefix, slots in blocks:
            if pages[h] >= 0:
                self.pages[pages[h]] = (prefix, slots)
                written.append((h, pages[h]))
        self.meta.confirm_write_for_keys(0, written, [])

    def on_meta(self, meta, scheduler_output) -> None:
        """Loads run now (their keys read when the worker starts them); saves
        are read when this step's output returns. The metadata's lists are
        the connector's own (it extends them later): copied now, as the
        worker receives them."""
        size, saves = self._size(), []
        for req in getattr(meta, "requests", ()):
            tokens, vllm_ids = tuple(int(t) for t in req.token_ids), list(req.block_ids)
            if req.load_block_op is not None and req.load_block_op.num_blocks_to_load > 0:
                self._load(req.request_id, tokens, vllm_ids, req.load_block_op)
            if req.save_block_op is not None:
                skip = req.save_block_op.skip_leading_blocks
                hashes = self._hashes(tokens, skip)
                table = self.target._to_spec_ids(vllm_ids[skip:skip + len(hashes)], 0)
                blocks = tuple((h, b, tokens[:(skip + i + 1) * size])
                               for i, (h, b) in enumerate(zip(hashes, table)))
                if blocks:
                    saves.append(Hf3fsSave(req.request_id, blocks))
        done = self.blockless & set(scheduler_output.finished_req_ids)
        self.blockless -= done
        self.steps.append((saves, done))

    def _load(self, rid: str, tokens, vllm_ids, op) -> None:
        size = self._size()
        n, first = op.num_blocks_to_load, op.num_computed_blocks
        blocks = self.target._to_spec_ids(vllm_ids[:n], 0)
        hashes = self._hashes(tokens, first, len(blocks))
        pages = self.meta.get_key_locations(0, hashes)
        values, unstored = {}, 0
        found = all(p is not None for p in pages)  # one key missing fails the task
        for i, page in enumerate(pages):
            start = (first + i) * size
            held = self.pages.get(page) if found else None
            unstored += held is None or held[0] != tokens[:start + size]
            if held is not None:
                values.update({start + s: v for s, v in enumerate(held[1])})
        unstored += len(blocks) - len(pages)
        self.land_load(rid, values, blocks, n * size, unstored * size)

    def before_output(self) -> None:
        """The oldest step's saves gather their blocks now (after its
        forward); the requests without blocks it named finished are sent."""
        if not self.steps:
            return
        saves, done = self.steps.pop(0)
        for save in saves:
            self._read(save)
        self.sends_done |= done

    def _read(self, save: Hf3fsSave) -> None:
        content, size = self.target.env.content, self._size()
        bad, blocks = [], []
        for h, block, prefix in save.blocks:
            slots = list(content.slots[block][:size])
            valid = get_valid_values(prefix, len(prefix))
            start = len(prefix) - size
            bad += [start + s for s, v in enumerate(slots) if v != valid[start + s]]
            blocks.append((h, prefix, slots))
        self._write(blocks)
        self.target.env.record_store(save.request_id, len(save.blocks) * size, tuple(bad))

    def get_stored(self, request, start: int = 0) -> int:
        """Where the run of whole blocks some page holds ends, from the block
        of ``start`` (by the tokens it was saved for, not by its key)."""
        held = {prefix for prefix, _ in self.pages.values()}
        return get_block_run(request.all_token_ids, held, self._size(), start)

    def get_reads_in_flight(self, request) -> bool:
        """A save of a step still in flight (async scheduling) has not
        gathered its blocks yet."""
        rid = request.request_id
        return any(s.request_id == rid for saves, _ in self.steps for s in saves)

    def on_finished(self, request, tables) -> None:
        if not any(b != NULL_BLOCK for t in tables for b in t):
            self.blockless.add(request.request_id)

    def get_sends_done(self) -> set[str]:
        done, self.sends_done = self.sends_done, set()
        return done


def get_lookup_answer_problem(answer) -> str:
    """What is wrong with a lookup's answer ("": nothing): a pair whose count is
    an integer (a bool there is a swapped pair) or None, and whose flag is a
    bool (an integer's truth is unambiguous too, numpy's included; a string
    "False" is true)."""
    if not is_pair(answer):
        return get_not_a_pair(answer)
    count, is_async = answer
    if not (count is None or is_int(count)):
        return f"num_tokens is {name_type(count)}, not an int or None"
    if not (isinstance(is_async, numbers.Integral) or is_numpy_bool(is_async)):
        return f"load_async is {name_type(is_async)}, not a bool"
    return ""


def get_meta_problem(meta) -> str:
    """What is wrong with a step's connector metadata ("": nothing): the
    worker asserts it is not None (any other object binds), and a
    MultiConnector's worker binds each child's part, which its child then
    asserts is there."""
    if meta is None:
        return "None (the worker asserts the step's metadata is there)"
    parts = getattr(meta, "metadata", None) if type(meta).__name__ == MULTI_META else None
    missing = [i for i, part in enumerate(parts or ()) if part is None]
    if missing:
        return (f"a {MULTI_META} whose child {missing[0]}'s metadata is None (that child's "
                "worker asserts it is there)")
    return ""


#: MultiConnector's metadata: one part per child connector
MULTI_META = "MultiKVConnectorMetadata"


def get_finish_answer_problem(answer) -> str:
    """What is wrong with ``request_finished``'s answer ("": nothing): a pair
    of a bool (an integer's truth is plain, numpy's bool too) and a dict or
    None."""
    if not is_pair(answer):
        return get_not_a_pair(answer)
    delay, params = answer
    if not (isinstance(delay, numbers.Integral) or is_numpy_bool(delay)):
        return f"delay_free_blocks is {name_type(delay)}, not a bool"
    if not (params is None or isinstance(params, dict)):
        return f"kv_transfer_params is {name_type(params)}, not a dict or None"
    return ""


def is_pair(answer) -> bool:
    """A tuple of two: the shape every pair-valued connector answer has."""
    return isinstance(answer, tuple) and len(answer) == 2


def get_not_a_pair(answer) -> str:
    size = f" of {len(answer)}" if isinstance(answer, (tuple, list)) else ""
    return f"{name_type(answer)}{size}, not a pair"


def is_int(value) -> bool:
    """An integer, numpy's included, and not a bool (a bool where a count
    belongs is a mistake: a swapped pair, a flag for a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def name_type(value) -> str:
    name = type(value).__name__
    return ("an " if name[0] in "aeiou" else "a ") + name


def is_numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


#: a transfer's field of the worker's report (``KVConnectorOutput``)
REPORT_FIELDS = {"load": "finished_recving", "send": "finished_sending"}


class ConnectorProbe:
    """Wraps one connector instance's scheduler-side methods (instance
    attributes shadow the class's, so ``isinstance`` checks vLLM makes, such
    as ``SupportsHMA``, still see the connector's own class)."""

    def __init__(self, connector, target, world) -> None:
        self.connector, self.target, self.world, self.env = connector, target, world, target.env
        #: request id -> whether its latest hit loads asynchronously
        self.is_async: dict[str, bool] = {}
        #: per transfer ("load", "send"): the requests whose transfer was
        #: started (an async load given blocks, a delayed free), the worker
        #: reported finished, and the scheduler was told of, each counted
        self.started = {"load": Counter(), "send": Counter()}
        self.reported = {"load": Counter(), "send": Counter()}
        self.passed = {"load": Counter(), "send": Counter()}
        #: requests ``request_finished`` was called for
        self.finished: set[str] = set()
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished",
                     "request_finished_all_groups"):
            inner = getattr(connector, name, None)
            if inner is not None:
                setattr(connector, name, self._wrap(name, inner))
        inner = connector.update_connector_output
        connector.update_connector_output = lambda output: self._report(inner, output)

    def _report(self, inner, output) -> None:
        """``update_connector_output``: what the connector adds to the worker's
        report (``finished_recving``, ``finished_sending``) is judged against
        what the worker reported (``report_names_finished_transfers``)."""
        before = {kind: set(getattr(output, REPORT_FIELDS[kind]) or ()) for kind in REPORT_FIELDS}
        inner(output)
        for kind, field in REPORT_FIELDS.items():
            after = set(getattr(output, field) or ())
            self.reported[kind].update(before[kind])
            for rid in sorted(after - before[kind]):
                self.env.record_report(rid, kind, self._get_report_state(kind, rid))
            self.passed[kind].update(after)
        self.env.held_back = {rid for rid, n in self.reported["load"].items()
                              if n > self.passed["load"][rid]}

    def _get_report_state(self, kind: str, rid: str) -> str:
        """What was known of a transfer the connector added to a report."""
        if self.reported[kind][rid] > self.passed[kind][rid]:
            return "withheld"
        if self.started[kind][rid] > self.reported[kind][rid]:
            return "in_flight"
        if self.passed[kind][rid]:
            return "passed_on"
        if kind == "send":
            return "not_delayed" if rid in self.finished else "not_finished"
        return "never_started"

    def _wrap(self, name, inner):
        after = getattr(self, "_after_" + name)

        def probed(*args, **kwargs):
            result = inner(*args, **kwargs)
            after(result, *args, **kwargs)
            return result
        probed.__name__ = name
        return probed

    def _after_get_num_new_matched_tokens(self, answer, request, num_computed_tokens):
        problem = get_lookup_answer_problem(answer)
        if problem:
            self.env.record_malformed_lookup(request, num_computed_tokens, answer, problem)
            raise ConnectorAnswerError(f"get_num_new_matched_tokens answered {answer!r} "
                                       f"({problem}), not (num_tokens or None, load_async)")
        self.is_async[request.request_id] = bool(answer[1])
        self.env.record_lookup(request, num_computed_tokens, answer,
                               self.world.get_stored(request, num_computed_tokens))

    def _after_update_state_after_alloc(self, _, request, blocks, num_external_tokens):
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        self.started["load"][rid] += self.is_async.get(rid, False)
        ids = self.target.get_spec_tables(blocks.get_block_ids())
        self.target._note_load(rid, ids)
        start, _ = self.env.answers.get(rid, (request.num_computed_tokens, 0))
        self.env.content.add_load(self.target.observe_request(rid), ids, start,
                                  num_external_tokens, self.is_async.get(rid, False))
        if not self.world.takes_loads_from_meta:
            self.env.record_load(rid, ids, None)

    def _after_build_connector_meta(self, meta, scheduler_output):
        problem = get_meta_problem(meta)
        self.env.record_meta(problem)
        if problem:
            raise ConnectorAnswerError(f"build_connector_meta returned {problem}")
        self.world.on_meta(meta, scheduler_output)

    def _after_request_finished(self, answer, request, block_ids):
        problem = get_finish_answer_problem(answer)
        if problem:
            self.env.record_malformed_finish(request.request_id, answer, problem)
            raise ConnectorAnswerError(f"request_finished answered {answer!r} ({problem}), "
                                       "not (delay_free_blocks, kv_transfer_params or None)")
        delay = bool(answer[0])
        rid = request.request_id
        self.started["send"][rid] += delay
        self.finished.add(rid)
        self.env.content.cancel_load(rid)
        tables = self.target.get_spec_tables(block_ids)
        if delay and any(b != NULL_BLOCK for t in tables for b in t):
            real = request.num_computed_tokens - getattr(request, "num_output_placeholders", 0)
            self.env.content.start_send(rid, tables[0], min(real, request.num_tokens))
        self.world.on_finished(request, tables)
        self.env.record_finish(rid, delay, self.world.get_reads_in_flight(request))

    _after_request_finished_all_groups = _after_request_finished


