"""docs/spec.md is generated from the registry and must not go stale."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.docgen import BEGIN_MARKER, END_MARKER, render_spec_md
from kvspec.spec.catalogue import REGISTRY
from kvspec.vllm_map import CONSTRAINS

ROOT = Path(__file__).resolve().parents[1]
SPEC_MD = ROOT / "docs" / "spec.md"


def _committed() -> str:
    assert SPEC_MD.exists(), "docs/spec.md is missing: run `python -m kvspec.docgen`"
    return SPEC_MD.read_text(encoding="utf-8")


def test_spec_md_is_up_to_date():
    assert render_spec_md() == _committed(), "docs/spec.md is stale: run `python -m kvspec.docgen`"


def test_render_is_deterministic():
    assert render_spec_md() == render_spec_md()


def test_every_registry_entry_is_documented():
    text = _committed()
    generated = text[text.index(BEGIN_MARKER):text.index(END_MARKER)]
    missing = [name for name in REGISTRY if f"### {name}\n" not in generated]
    assert not missing, f"docs/spec.md lacks {missing}: run `python -m kvspec.docgen`"


@pytest.mark.parametrize("name", list(REGISTRY))
def test_invariant_has_doc_and_cites(name):
    inv = REGISTRY[name]
    assert inv.doc.strip(), f"{name} has no docstring"
    assert inv.cites.strip(), f"{name} has no cites"


def test_proofs_md_is_up_to_date():
    from kvspec.docgen import PROOFS_PATH, render_proofs_md
    assert PROOFS_PATH.read_text(encoding="utf-8") == render_proofs_md(), (
        "docs/proofs.md is stale: run `python -m kvspec.docgen`")


def test_every_claim_says_what_it_constrains_in_vllm():
    assert set(CONSTRAINS) == set(REGISTRY), set(REGISTRY) ^ set(CONSTRAINS)


def test_reviewers_kit_is_in_the_spec():
    text = _committed()
    for heading in ("### How to check your scheduler change", "### The observation map",
                    "### Frame table", "### Statuses", "### What is not modelled",
                    "## Safety claims and design rules", "## Witnessed, not just checked"):
        assert heading in text, heading


def test_fix_diffs_live_in_one_place_and_every_link_to_one_resolves():
    """The fixes are kept once, as kvspec applies them at import
    (kvspec/harness/patches/fixes/); the docs link there, and every link to a
    diff from a Markdown page resolves to a file."""
    import re
    applied = ROOT / "kvspec" / "harness" / "patches" / "fixes"
    assert sorted(applied.glob("*.diff")), "no fixes under kvspec/harness/patches/fixes/"
    assert not (ROOT / "docs" / "findings" / "fixes").exists(), \
        "a second copy of the fixes under docs/findings/fixes/: link to the one copy"
    linked = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+\.diff)\)", page.read_text()):
            linked += 1
            assert (page.parent / target).resolve().is_file(), f"{page.name}: {target}"
    assert linked >= 20


def _load_script(relative: str):
    """A script of bench/ or scripts/ (not a package) as a module."""
    import importlib.util
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_planted_table_is_rendered_from_the_committed_results():
    """docs/findings/README.md quotes bench/planted_results.json, not numbers typed by hand."""
    import json
    bench = _load_script("bench/bench_planted.py")
    result = json.loads((ROOT / "bench" / "planted_results.json").read_text())
    assert len(result["rows"]) >= 6 and all(r["caught"] for r in result["rows"])
    readme = bench.FINDINGS_README.read_text()
    assert bench.render_readme(result, readme) == readme, (
        "stale: python bench/bench_planted.py --render")


def test_affected_releases_are_rendered_from_the_committed_replays():
    """Each write-up's "Affected releases" section quotes bench/releases/, the replays
    of every trace on every measured release, not results typed by hand."""
    render = _load_script("scripts/render_affected_releases.py")
    replays = render.load_replays()
    assert "0.32.0" in replays and len(replays) >= 2
    for path in sorted((ROOT / "docs" / "findings").glob("vllm-*.md")):
        assert render.rendered(path, replays) == path.read_text(), (
            f"{path.name} is stale: python scripts/render_affected_releases.py")
        for name in render.TRACE_NAME.findall(path.read_text()):
            assert (ROOT / "docs" / "findings" / name).is_file(), f"{path.name} names {name}"
