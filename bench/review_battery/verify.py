"""Check the review battery's edits against the installed vLLM.

For every ``edits/*.diff``:

1. ``unidiff`` parses it: one or more files, each ``a/vllm/...`` -> ``b/vllm/...``,
   and the header says ``expected: pass`` or ``expected: regression``;
2. the files it edits are copied from the installed package into a scratch tree,
   where ``patch -p1 --dry-run`` and then ``patch -p1`` apply it cleanly (no fuzz,
   no offset is required but offsets are reported);
3. every edited file compiles (``py_compile``);
4. its hunks fit the pristine source as written (each hunk's old lines occur
   exactly once, the rule kvspec applies its fixes by), and each kvspec fix of
   0.32.0 (``kvspec/harness/patches/fixes/*.diff`` without ``@``) is tried on the
   edited source: "as written" lists the fixes whose hunks no longer fit exactly
   (the edit touched their context or their changed lines); "located" lists
   those that do not fit even when each change is located by the code it
   changes (``kvspec.harness.hunk_apply``, where this checkout has it).

Nothing under the installed vLLM is written. Run from the repository root:

    .venv/bin/python bench/review_battery/verify.py [--json]
"""
from __future__ import annotations

import argparse
import json
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from unidiff import PatchSet

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from kvspec.harness.hunk_apply import HunkDoesNotFit  # noqa: E402
from kvspec.harness.hunk_apply import apply_hunks as apply_located  # noqa: E402
from kvspec.harness.vllm_patches import PATCHES_DIR  # noqa: E402
from kvspec.harness.vllm_patches import PatchDoesNotFit as DoesNotFit  # noqa: E402
from kvspec.harness.vllm_patches import _apply_exactly, _hunks_by_module  # noqa: E402


def hunks_by_module(diff_text: str) -> dict[str, list]:
    """Module name -> its hunks (``a/vllm/x/y.py`` -> ``vllm.x.y``): kvspec's own reader."""
    return _hunks_by_module(diff_text)


def apply_exactly(text: str, hunks) -> str:
    """Each hunk where its old lines occur exactly once: the rule kvspec applies fixes by."""
    return _apply_exactly(text, hunks, "edit")


def site_packages() -> Path:
    import vllm
    return Path(vllm.__file__).resolve().parents[1]


def header_fields(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("---"):
            break
        m = re.match(r"# (expected|inside-fix-function|function|file): *(.*)", line)
        if m:
            fields[m.group(1)] = m.group(2).strip()
    return fields


def fixes_0_32_0() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted((PATCHES_DIR / "fixes").glob("*.diff"))
            if "@" not in p.name}


def check(diff_path: Path, site: Path) -> dict:
    text = diff_path.read_text()
    result: dict = {"edit": diff_path.stem, "problems": []}
    problems = result["problems"]
    fields = header_fields(text)
    result.update(expected=fields.get("expected"), function=fields.get("function"),
                  inside_fix_function=fields.get("inside-fix-function", "").split(" ")[0])
    if fields.get("expected") not in ("pass", "regression"):
        problems.append("header lacks 'expected: pass|regression'")

    patch_set = PatchSet(text)
    paths = []
    for pf in patch_set:
        if not pf.source_file.startswith("a/vllm/") or not pf.target_file.startswith("b/vllm/"):
            problems.append(f"bad paths {pf.source_file} -> {pf.target_file}")
        paths.append(pf.source_file[2:])
    result["files"] = paths
    result["lines_changed"] = sum(pf.added + pf.removed for pf in patch_set)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rel in paths:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(site / rel, root / rel)
        for args in (["--dry-run"], []):
            run = subprocess.run(["patch", "-p1", "--no-backup-if-mismatch", *args],
                                 input=text, cwd=root, capture_output=True, text=True)
            if run.returncode != 0 or re.search(r"fuzz|FAILED|rejects", run.stdout):
                problems.append(f"patch -p1 {' '.join(args)} failed: {run.stdout.strip()}")
                break
        else:
            for rel in paths:
                try:
                    py_compile.compile(str(root / rel), doraise=True,
                                       cfile=str(root / (rel + "c")))
                except py_compile.PyCompileError as exc:
                    problems.append(f"{rel} does not compile: {exc.msg}")

    # as written: the edit fits the pristine source; which fixes still fit after it
    edited: dict[str, str] = {}
    try:
        for module, hunks in hunks_by_module(text).items():
            src = (site / (module.replace(".", "/") + ".py")).read_text()
            edited[module] = apply_exactly(src, hunks)
    except DoesNotFit as exc:
        problems.append(f"does not fit the pristine source exactly: {exc}")
    as_written, located = [], []
    for fix_id, fix_text in fixes_0_32_0().items():
        fix_hunks = hunks_by_module(fix_text)
        if not set(fix_hunks) & set(edited):
            continue
        sources = {m: edited.get(m) or (site / (m.replace(".", "/") + ".py")).read_text()
                   for m in fix_hunks}
        try:
            for module, hunks in fix_hunks.items():
                apply_exactly(sources[module], hunks)
            continue
        except DoesNotFit:
            as_written.append(fix_id)
        try:
            for module, hunks in fix_hunks.items():
                apply_located(sources[module], hunks, module)
        except HunkDoesNotFit:
            located.append(fix_id)
    result["fixes_disturbed_as_written"] = as_written
    result["fixes_not_fitting_located"] = located
    result["ok"] = not problems
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    site = site_packages()
    results = [check(p, site) for p in sorted((HERE / "edits").glob("*.diff"))]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            located = r["fixes_not_fitting_located"]
            print(f"{'ok ' if r['ok'] else 'BAD'} {r['edit']:48} {r['expected']:10} "
                  f"+/-{r['lines_changed']}")
            if r["fixes_disturbed_as_written"]:
                print(f"    fixes no longer fitting as written: "
                      f"{', '.join(r['fixes_disturbed_as_written'])}")
            if located:
                print(f"    ... nor located by the code they change: {', '.join(located)}")
            for p in r["problems"]:
                print(f"    {p}")
        n_pass = sum(r["expected"] == "pass" for r in results)
        print(f"{len(results)} edits, {sum(r['ok'] for r in results)} ok, "
              f"{n_pass} expected to pass")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
