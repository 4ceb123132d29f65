"""Applying a fix at the level of the code it changes (kvspec/harness/hunk_apply.py):
a nearby unrelated line does not stop it; changed code does, and says why."""
from __future__ import annotations

import pytest
from unidiff import PatchSet

from kvspec.harness.hunk_apply import HunkDoesNotFit, apply_hunks

SOURCE = """\
def recover(self, requests):
    marked = set()
    for request in requests:
        blocks = self.blocks(request)
        if not blocks:
            continue
        first = self.first_failed(blocks)
        request.num_computed_tokens = first
    return marked


def finish(self, request):
    self.free(request)
    self.waiters.pop(request.id, None)
"""

DIFF = """\
--- a/vllm/x.py
+++ b/vllm/x.py
@@ -3,7 +3,8 @@
     for request in requests:
         blocks = self.blocks(request)
         if not blocks:
             continue
-        first = self.first_failed(blocks)
+        first = self.first_failed(blocks, marked)
+        self.evict(blocks[first:])
         request.num_computed_tokens = first
     return marked
"""


def hunks(diff: str = DIFF):
    return list(PatchSet(diff)[0])


def test_a_hunk_that_fits_as_written_applies_with_no_drift():
    text, drift = apply_hunks(SOURCE, hunks(), "x")
    assert "self.first_failed(blocks, marked)" in text and "self.evict(blocks[first:])" in text
    assert drift == []


def test_an_unrelated_line_beside_the_change_does_not_stop_it():
    """0.33.0 inserted lines next to what kvspec's fixes change."""
    drifted = SOURCE.replace("            continue\n",
                             "            continue\n        self.drain_deferred_loads()\n")
    text, drift = apply_hunks(drifted, hunks(), "x")
    assert "self.first_failed(blocks, marked)\n        self.evict(blocks[first:])" in text
    assert "self.drain_deferred_loads()" in text  # the source's own line stays
    assert len(drift) == 1 and "context lines differ" in drift[0]


def test_changed_code_does_not_fit_and_says_so():
    changed = SOURCE.replace("self.first_failed(blocks)", "self.first_failed(blocks, 0)")
    with pytest.raises(HunkDoesNotFit, match="is not there") as err:
        apply_hunks(changed, hunks(), "x")
    assert err.value.reason == "changed"


def test_a_source_that_already_has_the_change_is_told_apart():
    fixed, _ = apply_hunks(SOURCE, hunks(), "x")
    with pytest.raises(HunkDoesNotFit, match="already there") as err:
        apply_hunks(fixed, hunks(), "x")
    assert err.value.reason == "present"


def test_a_pure_insertion_is_never_made_twice():
    diff = """\
--- a/vllm/x.py
+++ b/vllm/x.py
@@ -12,3 +12,4 @@
 def finish(self, request):
     self.free(request)
+    self.reservations.discard(request)
     self.waiters.pop(request.id, None)
"""
    once, _ = apply_hunks(SOURCE, hunks(diff), "x")
    assert once.count("self.reservations.discard(request)") == 1
    with pytest.raises(HunkDoesNotFit) as err:
        apply_hunks(once, hunks(diff), "x")
    assert err.value.reason == "present"
    # with an unrelated line between its neighbours, it is still placed after its own
    drifted = SOURCE.replace("    self.free(request)\n",
                             "    self.free(request)\n    self.log(request)\n")
    text, drift = apply_hunks(drifted, hunks(diff), "x")
    assert "self.free(request)\n    self.reservations.discard(request)\n" in text and drift


def test_code_that_occurs_twice_even_with_its_context_does_not_fit():
    drifted = SOURCE.replace("        if not blocks:\n            continue\n", "")
    twice = drifted + "\n\n" + drifted.split("\n\n\n")[0].replace("def recover", "def again")
    with pytest.raises(HunkDoesNotFit, match="several places"):
        apply_hunks(twice, hunks(), "x")
    # the context that is left still places it when it occurs once
    text, drift = apply_hunks(drifted, hunks(), "x")
    assert "self.evict(blocks[first:])" in text and drift
