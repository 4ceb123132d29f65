"""Checkers independent of what they check (issue 25, part 5).

A claim that calls the function the reference scheduler uses for the same rule
agrees with a bug inside it. The reference's placeholder arithmetic
(``spec/arith.py``) and block arithmetic (``spec/groups.py``) once fed the
ghost behind ``placeholders_match_in_flight``, ``every_group_serves_computed``
and the data oracle's reads; now those read their own description (the shares
of the steps in flight; ``spec/reads.py``). Here a bug is planted inside each
formerly shared helper, everywhere it is referenced, as an edit of its body
would, and the default check on the reference must catch it.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import kvspec.impl.in_flight  # noqa: F401 - the reference's users of the helpers, loaded
import kvspec.impl.kv_cache_manager  # noqa: F401
import kvspec.impl.scheduler  # noqa: F401
from kvspec.run import default_check
from kvspec.spec import arith, groups

ROOT = Path(__file__).resolve().parents[1]
#: what judges: the claims, the data oracle, the relations, the models, the ghost keeper
CHECKERS = ["spec/invariants.py", "spec/oracle.py", "spec/actions.py", "spec/conformance.py",
            "spec/effects.py", "spec/pool_effects.py", "spec/liveness.py", "spec/reads.py",
            "kvspec/harness/runner.py"]
#: names both sides may import: the vocabulary, not a rule
VOCABULARY = {"NULL_BLOCK", "GroupSpec", "RequestStatus"}


def _spec_imports(paths) -> set[str]:
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvspec.spec"):
                names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_no_checker_imports_a_rule_the_reference_uses():
    reference = _spec_imports((ROOT / "impl").glob("*.py"))
    checkers = _spec_imports(ROOT / p for p in CHECKERS)
    shared = {n for n in reference & checkers if n.rsplit(".", 1)[1] not in VOCABULARY}
    assert not shared, shared


def _plant(monkeypatch, module, name: str, bad) -> None:
    """Replace ``module.name`` in every kvspec module that holds it."""
    original = getattr(module, name)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("kvspec"):
            for attr, value in list(vars(mod).items()):
                if value is original:
                    monkeypatch.setattr(mod, attr, bad)


def _windowed(group) -> bool:
    return group.kind != "full_attention"


_SCHEDULE, _OUTPUT = arith.compute_placeholders_after_schedule, arith.compute_placeholders_after_output
_READ_START, _NEEDED = groups.compute_read_start, groups.get_needed_blocks
_SKIPPED = groups.compute_num_skipped_blocks

#: the claims that count placeholders their own way: the shares of the steps in
#: flight, and the conformance model's schedule and sample (spec/effects.py)
PLACEHOLDER_CLAIMS = {"placeholders_match_in_flight", "transition_admitted_by_model"}

#: helper -> (module, a bug inside it, the claims one of which must see it, or None for any)
PLANTS = {
    "chunk-owns-a-share": (arith, "compute_placeholders_after_schedule",
                           lambda held, drafts, chunk: held + 1 + drafts,
                           PLACEHOLDER_CLAIMS),
    "output-forgets-rejected-drafts": (arith, "compute_placeholders_after_output",
                                       lambda held, drafts, sampled, stale:
                                       held if stale else held - sampled,
                                       PLACEHOLDER_CLAIMS),
    # before spec/reads.py the data oracle read windows with this very function,
    # and the check held for 30 s with it planted
    "window-read-starts-one-late": (groups, "compute_read_start",
                                    lambda g, n: _READ_START(g, n) + (
                                        1 if g.kind == "sliding_window" and n > 0 else 0),
                                    None),
    "hit-misses-a-window-block": (groups, "get_needed_blocks",
                                  lambda g, n: range(_NEEDED(g, n).start + _windowed(g),
                                                     _NEEDED(g, n).stop), None),
    "frees-one-block-too-many": (groups, "compute_num_skipped_blocks",
                                 lambda g, n: _SKIPPED(g, n) + (_windowed(g) and n > 0), None),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_bug_inside_a_formerly_shared_helper_is_caught(plant, monkeypatch, tmp_path):
    module, name, bad, claim = PLANTS[plant]
    _plant(monkeypatch, module, name, bad)
    result, _ = default_check("impl", 30, 0, tmp_path)
    assert result.counterexample is not None, f"{plant} inside {name} survived 30 s"
    if claim:
        assert claim & {v.invariant for v in result.counterexample.violations}
