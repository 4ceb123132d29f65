"""How the worker's KV is modelled, shared by the model runner and the torch
worker (kept apart so that neither imports the other's module at load)."""
from __future__ import annotations

#: the claim the torch worker reports under (kvspec/harness/torch_worker.py)
KV_CLAIM = "kv_tensors_match_oracle"

#: "symbolic" (the data oracle alone) or "torch" (real tensors beside it)
KV_MODES = ("symbolic", "torch")


class KVWorkerError(Exception):
    """The torch worker and the data oracle disagree about the environment:
    a harness bug, never a finding of the target."""
