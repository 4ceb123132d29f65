"""What the installed vLLM does with a load failure in each kind of KV cache group.

    HF_HUB_OFFLINE=1 /work/venvs/vllm-VERSION/bin/python scripts/probe_hybrid_releases.py \
        [--json bench/releases/hybrid-VERSION.json]

One fixed scenario per cell, run on the ``vllm`` target as released
(``vllm?fixes=none``) and with every fix that fits (``vllm``): a full-attention
group and a sliding window of 4 tokens (block size 2), or a full-attention group
and a last-state group (vLLM's align-mode Mamba, where the release maps it), one
request of 7 tokens whose first 6 the external store holds, loaded synchronously
or asynchronously; the load fails in one group of each kind; under
each failure policy. Scheduling is synchronous, so what a cell shows is the
failure handling alone. The failure reaches vLLM as an HMA connector reports it:
``failed_recving`` for an async load where the release has the field, block ids
otherwise (``VllmTarget._failure_report``).

Each cell is the verdict: ``holds`` (every claim holds through the request's
end), the claims violated, or the exception for ``target_crashed``. Used for the
hybrid column of docs/vllm-releases.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvspec.harness.accepted_findings import installed_vllm_version  # noqa: E402
from kvspec.harness.machine import make_groups  # noqa: E402
from kvspec.harness.runner import Runner  # noqa: E402
from kvspec.harness.target import make_config  # noqa: E402

#: group kind failing -> (layout, index of that group in it)
GROUPS = {"full_attention": ("sliding", 0), "sliding_window": ("sliding", 1),
          "last_state": ("state", 1)}
LOADS = ("sync", "async")
POLICIES = ("recompute", "fail")
TARGETS = {"as_released": "vllm?fixes=none", "with_fixes": "vllm"}


def scenario(load: str, group: int) -> list[dict]:
    add = {"op": "add", "id": "r0", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 2, "ext": 6,
           "async": load == "async"}
    fail = {"op": "step", "fail": ["r0"], "fail_group": group, "fail_offset": 0}
    if load == "async":  # issue the load, then finish it failing
        return [add, {"op": "step"}, {**fail, "finish_loads": ["r0"]}, {"op": "drain"}]
    return [add, fail, {"op": "drain"}]


def verdict(target: str, load: str, kind: str, policy: str) -> str:
    layout, group = GROUPS[kind]
    config = make_config(block_size=2, num_blocks=12, max_num_batched_tokens=16,
                         max_num_seqs=2, max_model_len=16, kv_load_failure_policy=policy,
                         groups=make_groups(layout, 2, 4))
    try:
        failure = Runner(target, config).run(scenario(load, group))
    except Exception as exc:  # noqa: BLE001 - the release could not run the scenario
        return f"error: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    if failure is None:
        return "holds"
    parts = []
    for v in failure.violations:
        if v.invariant == "target_crashed":
            parts.append(f"crash: {v.message.split(':', 1)[0]}")
        elif v.invariant not in parts:
            parts.append(v.invariant)
    return "; ".join(dict.fromkeys(parts))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the cells here")
    args = parser.parse_args(argv)
    cells = {}
    for name, target in TARGETS.items():
        for load in LOADS:
            for kind in GROUPS:
                for policy in POLICIES:
                    key = f"{load}/{kind}/{policy}"
                    cells.setdefault(name, {})[key] = verdict(target, load, kind, policy)
                    print(f"{name:12} {key:35} {cells[name][key]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"vllm": installed_vllm_version(), "cells": cells},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
