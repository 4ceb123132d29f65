"""One string-hash seed for every kvspec run.

Python salts ``str`` hashes per process, and sets of request ids are
iterated in hash order: vLLM frees the blocks of a step's finished sends in
that order, so in another process a trace could replay onto other block ids
(seen in about one fuzz run in 150). ``kvspec`` therefore runs with
``PYTHONHASHSEED=0`` unless its caller chose a seed: the first time, it starts
itself again with the seed set (the same process id, arguments and exit code).
"""
from __future__ import annotations

import os
import sys

SEED = "0"


def pin_hash_seed() -> None:
    if os.environ.get("PYTHONHASHSEED") is not None:
        return
    os.environ["PYTHONHASHSEED"] = SEED
    os.execv(sys.executable, [sys.executable, "-m", "kvspec", *sys.argv[1:]])
