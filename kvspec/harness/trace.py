"""Traces are data: one self-contained JSON format that the fuzzer writes, that
Z3 counterexamples will write, and that ``kvspec replay`` runs on any target."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import attrs

from kvspec.spec.state import Config, GroupSpec

FORMAT = "kvspec-trace/1"
OPS = {"add", "step", "abort", "reset_prefix_cache", "drain"}
#: what an action must carry to be replayed, by op
REQUIRED = {"add": {"id": str, "prompt": list, "max_tokens": int}, "abort": {"id": str}}


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message is one line."""


def config_to_dict(config: Config) -> dict:
    data = attrs.asdict(config)
    data["groups"] = [attrs.asdict(g) for g in config.groups]
    return data


def config_from_dict(data: dict) -> Config:
    try:
        groups = tuple(GroupSpec(**g) for g in data["groups"])
        return Config(**{**data, "groups": groups})
    except (KeyError, TypeError) as exc:
        raise TraceError(f"bad config in trace: {exc}") from None


def save_trace(path: Path, *, target: str, config: Config, actions: list[dict],
               violations=(), steps=(), seed=None) -> Path:
    """Write atomically: a crash mid-write never leaves a half trace behind."""
    payload = {
        "format": FORMAT, "target": target, "seed": seed, "config": config_to_dict(config),
        "actions": actions,
        "verdict": [{"invariant": v.invariant, "message": v.message} for v in violations],
        "steps": [{"index": s.index, "action": s.action, "requests": s.requests} for s in steps],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".trace-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
    return path


def load_trace(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TraceError(f"no such trace file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not a kvspec trace (invalid JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TraceError(f"{path}: not a kvspec trace (expected format {FORMAT!r})")
    actions = data.get("actions")
    if not isinstance(actions, list) or not all(
            isinstance(a, dict) and a.get("op") in OPS for a in actions):
        raise TraceError(f"{path}: malformed trace: actions must be a list of known ops {sorted(OPS)}")
    for action in actions:
        check_action(path, action)
    data["config"] = config_from_dict(data.get("config") or {})
    return data


def check_action(path, action: dict) -> None:
    """A replayable action carries its op's fields with the right types; a
    malformed one is the trace's fault, not a target crash."""
    for key, kind in REQUIRED.get(action["op"], {}).items():
        if not isinstance(action.get(key), kind):
            raise TraceError(f"{path}: malformed action {action!r}: "
                             f"{key!r} must be a {kind.__name__}")
