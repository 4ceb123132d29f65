"""Traces are data: one self-contained JSON format that the fuzzer writes, that
Z3 counterexamples will write, and that ``kvspec replay`` runs on any target.

A trace is checked when it is loaded, in three passes, before anything runs:

1. its shape, against one JSON Schema (``TRACE_SCHEMA``): the format, the
   configuration, each action with the fields its op may carry and their
   types (integers are integers, not booleans or floats), the verdict, the
   step table;
2. what the environment could produce (``check_semantics``): an arrival has a
   fresh id, a prompt that fits under ``max_model_len`` and a store that holds
   at most the prompt (unless ``overclaim_ok`` asks for a contract violation
   on purpose); steps, aborts and faults name requests added before them;
3. its size (``check_size``): at most ``MAX_TRACE_TOKENS`` tokens over its
   arrivals, and a replay that takes minutes, not hours.

A trace that fails any is malformed (:class:`TraceError`, one line naming
the field and its value), never a finding of the target it is replayed on.
"""
from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path

import attrs
import jsonschema
from jsonschema import validators

from kvspec.harness.drain import DRAIN_SLACK, compute_drain_work
from kvspec.text import shown
from kvspec.spec.state import (BATCH_QUEUE_DEPTH, FAILURE_POLICIES, GROUP_KINDS, KV_ROLES,
                               LIMITS, MAX_DRAFTS, POLICIES, Config, GroupSpec,
                               get_default_kv_delivery)

FORMAT = "kvspec-trace/1"
OPS = ("add", "step", "abort", "reset_prefix_cache", "drain")
#: larger than any trace kvspec writes (a small run's are kilobytes, a
#: production-sized run's some megabytes); a bigger file is not a trace, and
#: parsing one stays within a few hundred MB
MAX_TRACE_BYTES = 64 << 20
#: the most actions a trace may hold (kvspec writes tens; checking one takes ~50 µs)
MAX_ACTIONS = 10_000
#: how much of an offending value an error line shows
SHOWN = 60


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message is one line."""


# -- the schema ----------------------------------------------------------------

def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


#: the longest request id a trace may carry
MAX_ID_LENGTH = 64
#: request ids are printed in step tables: printable characters only (no control or
#: format characters, line breaks or lone surrogates, which act on a terminal or
#: cannot be encoded)
_ID = {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH, "format": "printable"}
_IDS = {"type": "array", "items": _ID, "uniqueItems": True}
_BOOL = {"type": "boolean"}
_INT32 = 2 ** 31 - 1

#: the fields each op may carry (the fuzzer, kvspec.harness.machine, draws
#: narrower ranges; these bounds keep any replay finite), and those it must carry
ACTION_FIELDS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "add": ({
        "id": _ID,
        "prompt": {"type": "array", "minItems": 1, "maxItems": LIMITS["max_model_len"][1] - 1,
                   "items": _int(0, _INT32)},
        "max_tokens": _int(1, LIMITS["max_model_len"][1]),
        "priority": _int(-_INT32 - 1, _INT32),
        "ext": _int(0, LIMITS["max_model_len"][1]),   # prompt tokens the store holds
        "async": _BOOL,
        "none": _int(0, 10),      # "not yet" answers before the first real one
        "send": _BOOL,
        "offload": _BOOL,
        "overclaim_ok": _BOOL,    # a connector contract violation, on purpose
        "beyond_contract": _BOOL,  # answers outside vLLM's in-tree connector contract
        "pd": _BOOL,  # P/D kv_transfer_params: do_remote_prefill (consumer), do_remote_decode
    }, ("id", "prompt", "max_tokens")),
    "step": ({
        "finish_loads": _IDS, "fail": _IDS, "fail_all": _BOOL,
        "fail_offset": _int(0, LIMITS["max_model_len"][1]),
        "fail_blocks": _int(1, LIMITS["num_blocks"][1]),  # consecutive failed blocks
        "fail_group": _int(0, LIMITS["groups"][1] - 1),  # the KV cache group the failure hits
        "eos": _IDS, "finish_sends": _IDS,
        "accept": _int(0, 16),
        "drafts": _int(0, MAX_DRAFTS),   # the target is configured for this many drafts
    }, ()),
    "abort": ({"id": _ID}, ("id",)),
    "reset_prefix_cache": ({"running": _BOOL}, ()),
    "drain": ({}, ()),
}


def _action_schema() -> dict:
    branches = []
    for op, (fields, required) in ACTION_FIELDS.items():
        branches.append({
            "if": {"properties": {"op": {"const": op}}, "required": ["op"]},
            "then": {"properties": {"op": {"const": op}, **fields},
                     "required": ["op", *required], "additionalProperties": False}})
    return {"type": "object", "required": ["op"], "properties": {"op": {"enum": list(OPS)}},
            "allOf": branches}


_CONFIG_SCHEMA = {
    "type": "object",
    "required": ["groups", "num_blocks", "max_num_batched_tokens", "max_num_seqs",
                 "max_model_len"],
    "additionalProperties": False,
    "properties": {
        "groups": {"type": "array", "minItems": LIMITS["groups"][0],
                   "maxItems": LIMITS["groups"][1],
                   "items": {"type": "object", "required": ["block_size"],
                             "additionalProperties": False,
                             "properties": {"block_size": _int(*LIMITS["block_size"]),
                                            "kind": {"enum": list(GROUP_KINDS)},
                                            "sliding_window": _int(
                                                0, LIMITS["max_model_len"][1])}}},
        **{name: _int(*LIMITS[name]) for name in (
            "num_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
            "long_prefill_token_threshold", "num_speculative_tokens",
            "max_concurrent_batches")},
        "policy": {"enum": list(POLICIES)},
        "kv_load_failure_policy": {"enum": list(FAILURE_POLICIES)},
        "enable_prefix_caching": _BOOL,
        "async_scheduling": _BOOL,
        "long_prefill_token_threshold_adaptive": _BOOL,
        "kv_role": {"enum": list(KV_ROLES)},
        "kv_connector": _BOOL,
        "requires_kv_delivery": _BOOL,
    },
}

_VERDICT_SCHEMA = {"type": "array", "items": {
    "type": "object", "required": ["invariant", "message"],
    "additionalProperties": False,
    "properties": {"invariant": {"type": "string", "minLength": 1, "maxLength": 200,
                                 "format": "printable"},
                   "message": {"type": "string"}}}}

TRACE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvspec trace",
    "type": "object",
    "required": ["format", "target", "config", "actions"],
    "additionalProperties": False,
    "properties": {
        "format": {"const": FORMAT},
        "target": {"type": "string", "minLength": 1, "maxLength": 4000},
        "seed": {"type": ["integer", "null"]},
        # the worker's KV (runner.KV_MODES); absent: symbolic. Under "torch" the
        # model samples the tokens, so a trace replays only in its own mode
        "kv": {"enum": ["symbolic", "torch"]},
        "config": _CONFIG_SCHEMA,
        # the vLLM a trace of the vllm target was found on (vllm_source.VllmSource
        # .as_dict()): information for the reader; a replay runs the vLLM it is given
        "vllm_source": {"type": "object", "maxProperties": 20},
        "actions": {"type": "array", "maxItems": MAX_ACTIONS, "items": _action_schema()},
        "verdict": _VERDICT_SCHEMA,
        # a finding's continuation: what the replay gives with some claims unchecked
        # (`kvspec replay --ignore`), to show the harm a first violation leads to
        "harm": {"type": "object", "required": ["ignoring", "verdict"],
                 "additionalProperties": False,
                 "properties": {"ignoring": {"type": "array", "minItems": 1, "items": {
                     "type": "string", "minLength": 1, "maxLength": 200, "format": "printable"}},
                     "verdict": _VERDICT_SCHEMA}},
        "steps": {"type": "array", "items": {
            "type": "object", "required": ["index", "action", "requests"],
            "additionalProperties": False,
            "properties": {"index": {"type": "integer", "minimum": 0},
                           "action": {"type": "string"}, "requests": {"type": "string"}}}},
    },
}

# JSON Schema counts 1.0 as an integer and Python counts True as one; a trace does not.
_TYPES = validators.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda checker, value: isinstance(value, int) and not isinstance(value, bool))
TraceValidator = validators.extend(validators.Draft202012Validator, type_checker=_TYPES)
TraceValidator.check_schema(TRACE_SCHEMA)
#: "format" is asserted, and only kvspec's own format is known
FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("printable")
def _printable(value) -> bool:
    return not isinstance(value, str) or value.isprintable()


_VALIDATOR = TraceValidator(TRACE_SCHEMA, format_checker=FORMATS)


# -- one line per error ----------------------------------------------------------

def short(value, limit: int = SHOWN) -> str:
    """``repr(value)``, cut to ``limit`` characters (a long prompt stays one short line)."""
    try:
        text = repr(value)
    except RecursionError:
        return "<deeply nested value>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def field_path(path) -> str:
    """``["actions", 3, "max_tokens"]`` -> ``actions[3].max_tokens``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_TYPE_NAMES = {"integer": "an integer", "string": "a string", "boolean": "true or false",
               "array": "a list", "object": "an object", "null": "null"}


def describe(error: jsonschema.ValidationError) -> str:
    """One short line for a schema error: what was expected and what was there."""
    kind, expected, value = error.validator, error.validator_value, error.instance
    if kind == "type":
        names = [expected] if isinstance(expected, str) else expected
        return f"expected {' or '.join(_TYPE_NAMES.get(n, n) for n in names)}, got {short(value)}"
    if kind == "required":
        missing = [k for k in expected if k not in value]
        return f"missing field {missing[0]!r}"
    if kind == "additionalProperties":
        known = error.schema.get("properties", {})
        extra = [k for k in value if k not in known]
        allowed = ", ".join(sorted(k for k in known if k != "op")) or "no other field"
        what = f" for op {value['op']!r} (it takes {allowed})" if "op" in value else ""
        return f"unknown field {short(extra[0])}{what}"
    if kind == "enum":
        return f"must be one of {', '.join(map(repr, expected))}, got {short(value)}"
    if kind == "const":
        return f"must be {expected!r}, got {short(value)}"
    if kind == "minimum":
        return f"must be >= {expected}, got {short(value)}"
    if kind == "maximum":
        return f"must be <= {expected}, got {short(value)}"
    if kind in ("minItems", "minLength") and expected == 1:
        return f"must not be empty, got {short(value)}"
    if kind == "minItems":
        return f"needs at least {expected} items, got {len(value)}"
    if kind == "maxItems":
        return f"takes at most {expected} items, got {len(value)}"
    if kind == "maxLength":
        return f"takes at most {expected} characters, got {len(value)}"
    if kind == "format" and expected == "printable":
        return ("must be printable characters (no control or format characters, line "
                f"breaks or lone surrogates), got {short(value)}")
    if kind == "uniqueItems":
        return f"names an item twice: {short(value)}"
    return short(error.message, 2 * SHOWN)


def schema_error(data) -> str | None:
    """The first schema violation of ``data`` as ``where: what``, or None: the
    first error the validator meets (top-level fields in the schema's order,
    list items in order), and it stops there: a trace with a million bad items
    costs one error, not a million."""
    error = next(_VALIDATOR.iter_errors(data), None)
    if error is None:
        return None
    where = field_path(error.absolute_path) or "trace"
    return f"{where}: {describe(error)}"


# -- what the environment could produce -------------------------------------------

def check_semantics(config: Config, actions: list[dict]) -> str | None:
    """The first thing the environment could never produce, as ``where: why``:
    an arrival that reuses an id, does not fit
    under max_model_len, has a store holding more than its prompt (or anything,
    for a connector that only stores), or cannot
    finish alone in the pool; a step, abort or fault naming a request not added
    before it."""
    added: dict[str, int] = {}
    block_size = config.block_size
    for i, action in enumerate(actions):
        where = f"actions[{i}]"
        op = action["op"]
        if op == "add":
            rid, n, max_tokens = action["id"], len(action["prompt"]), action["max_tokens"]
            if rid in added:
                return (f"{where}.id: duplicate request id {short(rid)} "
                        f"(added by actions[{added[rid]}])")
            if n >= config.max_model_len:
                return (f"{where}.prompt: {n} tokens do not fit under max_model_len="
                        f"{config.max_model_len} (at most {config.max_model_len - 1})")
            ext = action.get("ext", 0)
            if ext > n and not action.get("overclaim_ok"):
                return (f"{where}.ext: the store cannot hold {ext} tokens of a {n}-token prompt "
                        "(set overclaim_ok to test a contract violation)")
            if (ext or action.get("offload")) and not config.is_kv_consumer:
                key = "ext" if ext else "offload"
                return (f"{where}.{key}: {get_connector_label(config)} loads nothing (an "
                        "offloading store loads its KV back): no ext, no offload")
            if action.get("send") and not config.is_kv_producer:
                return f"{where}.send: {get_connector_label(config)} sends nothing"
            if action.get("pd") and not config.kv_connector:
                return f"{where}.pd: P/D transfer params need a KV connector"
            # the KV a request computes before its last token: it must fit the pool alone
            need = -(-min(n + max_tokens - 1, config.max_model_len - 1) // block_size)
            if need > config.num_blocks:
                return (f"{where}: request {short(rid)} needs {need} blocks to finish alone "
                        f"(block size {block_size}), the pool has {config.num_blocks}")
            added[rid] = i
        elif op == "abort":
            if action["id"] not in added:
                return f"{where}.id: {short(action['id'])} names no request added before it"
        elif op == "step":
            for key in ("finish_loads", "fail", "eos", "finish_sends"):
                unknown = [rid for rid in action.get(key, ()) if rid not in added]
                if unknown:
                    return f"{where}.{key}: {short(unknown[0])} names no request added before it"
    return None


# -- how much a replay may cost ----------------------------------------------------

#: the most tokens a trace's arrivals may carry (each prompt plus its max_tokens)
MAX_TRACE_TOKENS = 1_100_000
#: the most work a replay may take, in units of about 2 µs of the reference target on
#: one core (measured: a call observes the whole pool, ~2 µs a block, and every
#: request, ~0.1 ms each): 10^8 units is some ``REPLAY_MINUTES`` minutes
MAX_REPLAY_WORK = 100_000_000
REPLAY_MINUTES = 3
#: work units of one call besides its pool blocks, and of one request it observes
CALL_UNITS, REQUEST_UNITS = 150, 64


def replay_work(config: Config, actions: list[dict]) -> tuple[int, int, int]:
    """``(tokens, calls, work)``: the tokens of the trace's arrivals, an upper bound
    on the scheduler calls a replay makes (one per action, and a drain steps at
    most ``drain.compute_drain_bound`` of its live requests; a request still
    live after a drain is a violation that ends the replay, so no request is
    drained twice), and that bound times what each call observes."""
    adds = [a for a in actions if a["op"] == "add"]
    tokens = sum(len(a["prompt"]) + a["max_tokens"] for a in adds)
    drains = sum(1 for a in actions if a["op"] == "drain")
    drained = compute_drain_work(config, [(len(a["prompt"]), a["max_tokens"]) for a in adds])
    calls = len(actions) + DRAIN_SLACK * drains + drained
    return tokens, calls, calls * (CALL_UNITS + config.num_blocks + REQUEST_UNITS * len(adds))


def is_well_within_limits(config: Config, actions: list[dict], share: float = 0.8) -> bool:
    """Replaying ``actions`` stays within ``share`` of ``check_size``'s limits:
    room for what a run adds after (a production-sized run stops adding long
    requests here, so that every trace it saves replays)."""
    tokens, _calls, work = replay_work(config, actions)
    return tokens <= share * MAX_TRACE_TOKENS and work <= share * MAX_REPLAY_WORK


def check_size(config: Config, actions: list[dict]) -> str | None:
    """Why replaying the trace could take more than minutes, or None."""
    tokens, calls, work = replay_work(config, actions)
    if tokens > MAX_TRACE_TOKENS:
        return (f"its arrivals carry {tokens} tokens (prompts plus max_tokens), at most "
                f"{MAX_TRACE_TOKENS}")
    if work > MAX_REPLAY_WORK:
        minutes = work / MAX_REPLAY_WORK * REPLAY_MINUTES
        requests = sum(1 for a in actions if a["op"] == "add")
        return (f"replaying it could take {minutes:.{1 if minutes < 10 else 0}f} minutes: up "
                f"to {calls} scheduler calls, each observing {config.num_blocks} blocks and "
                f"up to {requests} request{'s' * (requests != 1)}; the limit is about "
                f"{REPLAY_MINUTES} minutes: use fewer or shorter requests or a smaller pool")
    return None


# -- reading and writing ---------------------------------------------------------

def config_to_dict(config: Config) -> dict:
    data = attrs.asdict(config)
    # a group without a window is written as before sliding windows existed
    data["groups"] = [{k: v for k, v in attrs.asdict(g).items()
                       if k != "sliding_window" or v} for g in config.groups]
    if not data["async_scheduling"]:  # traces written before async scheduling stay as they were
        del data["async_scheduling"]
    if data["kv_role"] == "kv_both":  # likewise: the role was always kv_both before
        del data["kv_role"]
    if not data["num_speculative_tokens"]:  # likewise: no drafts under async before
        del data["num_speculative_tokens"]
    if not data["long_prefill_token_threshold_adaptive"]:  # likewise: a fixed cap before
        del data["long_prefill_token_threshold_adaptive"]
    # likewise: a connector, its delivery as its role implies, two steps in flight
    defaults = {"kv_connector": True, "max_concurrent_batches": BATCH_QUEUE_DEPTH,
                "requires_kv_delivery": get_default_kv_delivery(config.kv_connector,
                                                                config.kv_role)}
    for name, value in defaults.items():
        if data[name] == value:
            del data[name]
    return data


def get_connector_label(config: Config) -> str:
    """How a message names the configured connector."""
    return f"a {config.kv_role} connector" if config.kv_connector else "a run without a connector"


def config_from_dict(data: dict) -> Config:
    try:
        groups = tuple(GroupSpec(**g) for g in data["groups"])
        return Config(**{**data, "groups": groups})
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"bad config in trace: {exc}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_trace(path: Path, *, target: str, config: Config, actions: list[dict],
               violations=(), steps=(), seed=None, kv: str = "symbolic") -> Path:
    """Write atomically: a crash mid-write never leaves a half trace behind. The
    file is readable as any file the user creates (mode 0666 less the umask).
    A trace of the vllm target records which vLLM it ran on."""
    payload = {
        "format": FORMAT, "target": target, "seed": seed,
        **({"kv": kv} if kv != "symbolic" else {}), "config": config_to_dict(config),
        **_source_of(target),
        "actions": actions,
        "verdict": [{"invariant": v.invariant, "message": v.message} for v in violations],
        "steps": [{"index": s.index, "action": s.action, "requests": s.requests} for s in steps],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".trace-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_compact_numbers(json.dumps(payload, indent=1)))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


#: an array of integers as ``json.dumps(indent=1)`` writes it: one per line
_NUMBER_ARRAY = re.compile(r"\[\n[-\d,\s]+\]")


def _compact_numbers(text: str) -> str:
    """Every array of integers on one line (a prompt of 4,000 tokens is one
    line, not 4,000). Only arrays the indenting broke over lines: a string
    never holds a raw line break, so no text inside a string is touched."""
    return _NUMBER_ARRAY.sub(lambda m: re.sub(r"\s+", "", m.group()), text)


def _source_of(target: str) -> dict:
    """``{"vllm_source": ...}`` for a vllm target whose source this process has
    chosen (nothing is imported or chosen here), else nothing."""
    if not target.startswith("vllm"):
        return {}
    from kvspec.harness import vllm_source
    chosen = vllm_source.chosen()
    return {} if chosen is None else {"vllm_source": chosen.as_dict()}


class DuplicateKey(ValueError):
    """A JSON object names a key twice (json.loads would keep the last silently)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return data


def _read_json(path: Path):
    where = shown(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise TraceError(f"no such trace file: {where}") from None
    except OSError as exc:  # a symlink loop, a name too long, a directory we may not enter
        raise TraceError(f"{where}: cannot read trace ({exc.strerror or exc})") from None
    if stat.S_ISDIR(info.st_mode):
        raise TraceError(f"{where}: is a directory, not a trace file")
    if not stat.S_ISREG(info.st_mode):
        raise TraceError(f"{where}: not a regular file")
    if info.st_size > MAX_TRACE_BYTES:
        raise TraceError(f"{where}: not a kvspec trace ({info.st_size} bytes; traces are "
                         f"under {MAX_TRACE_BYTES >> 20} MiB)")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise TraceError(f"{where}: cannot read trace ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{where}: not a kvspec trace (not UTF-8 text: {exc.reason})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except DuplicateKey as exc:
        raise TraceError(f"{where}: malformed trace: key {short(exc.args[0])} appears twice "
                         "in one object") from None
    except RecursionError:
        raise TraceError(f"{where}: not a kvspec trace (JSON nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of thousands of digits
        raise TraceError(f"{where}: not a kvspec trace "
                         f"(invalid JSON: {short(str(exc), 100)})") from None


def load_trace(path: Path) -> dict:
    """The trace at ``path``, checked (see the module doc); ``config`` is a
    :class:`Config`. Raises :class:`TraceError` with one line otherwise."""
    path = Path(path)
    where = shown(path)
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TraceError(f"{where}: not a kvspec trace (expected format {FORMAT!r})")
    try:
        problem = schema_error(data)
    except RecursionError:
        problem = "trace: nested too deeply"
    if problem:
        kind = "malformed action" if problem.startswith("actions[") else "malformed trace"
        raise TraceError(f"{where}: {kind} {problem}" if kind == "malformed action"
                         else f"{where}: {kind}: {problem}")
    try:
        data["config"] = config_from_dict(data["config"])
    except TraceError as exc:
        raise TraceError(f"{where}: {exc}") from None
    problem = check_semantics(data["config"], data["actions"])
    if problem:
        kind = "impossible action" if problem.startswith("actions[") else "impossible trace:"
        raise TraceError(f"{where}: {kind} {problem}")
    problem = check_size(data["config"], data["actions"])
    if problem:
        raise TraceError(f"{where}: too large a trace: {problem}")
    return data
