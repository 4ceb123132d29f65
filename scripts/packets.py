"""Finding packets (issue 27): run their vLLM-style tests, render their facts.

    python scripts/packets.py test   [--python PY | --vllm SOURCE] [SLUG ...]
    python scripts/packets.py render [--vllm SOURCE] [--check]
    python scripts/packets.py rebase --vllm SOURCE

``test`` copies each packet's test into the release's own test tree (vLLM's
sdist from PyPI, as ``calibrate_vllm_tests.py`` fetches it; no build) and runs
it under vLLM's pytest configuration three ways: as released
(``KVSPEC_VLLM_FIXES=none``), with exactly the fixes the packet names, and
with every fix at once (the fixes combine). A ``fix`` or ``review`` packet's
test must fail as released and pass both other ways; a ``connector`` or
``no-fix`` packet's test must fail all three ways (nothing kvspec ships closes
it). The measured outcomes go to ``docs/findings/packets/results-RELEASE.json``;
exit 1 if any packet's test does not behave as its kind says.

``render`` writes the generated block of every packet's README (the code it
names, with line numbers read from the release's source; settings with their
defaults checked against the config classes; exposure; upstream; the release
table from kvspec's measured replays; the measured test outcomes) and the
index ``docs/findings/packets/README.md``. ``--check`` exits 1 if one is stale
or a named symbol or default is not in the source.

``rebase`` rewrites each fix's base diff so its line numbers are the source's
(the diffs are applied by context; a maintainer runs ``git apply``).

``SOURCE`` is a vLLM source as ``kvspec check --vllm`` takes it (a wheel, an
unpacked wheel, a checkout); the default is ``KVSPEC_VLLM`` or the installed vLLM.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import difflib
import functools
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
from calibrate_vllm_tests import CACHE, check_test_imports, get_tests  # noqa: E402
from render_affected_releases import load_replays, trace_rows  # noqa: E402
from vllm_test_models import write_cache  # noqa: E402

from kvspec.harness import vllm_source  # noqa: E402

PACKETS = ROOT / "docs" / "findings" / "packets"
FIXES_DIR = ROOT / "kvspec" / "harness" / "patches" / "fixes"
KINDS = ("fix", "review", "connector", "no-fix", "history")
#: kinds whose test some kvspec fix makes pass
FIXED_KINDS = ("fix", "review")
BEGIN, END = "<!-- packet facts -->", "<!-- end of packet facts -->"
INDEX_BEGIN, INDEX_END = "<!-- packet index -->", "<!-- end of packet index -->"
UPSTREAM = "https://github.com/vllm-project/vllm"


class PacketError(ValueError):
    """A packet that cannot be used; the message is one line."""


# -- reading packets ----------------------------------------------------------------

@attrs.frozen
class Packet:
    folder: Path
    data: dict

    @property
    def slug(self) -> str:
        return self.folder.name

    @property
    def kind(self) -> str:
        return self.data["kind"]

    @property
    def fixes(self) -> list[str]:
        return list(self.data.get("fixes", []))

    @property
    def not_ready(self) -> str | None:
        """Why the packet is not for upstream yet (None: it is)."""
        return self.data.get("not_ready")

    @property
    def test(self) -> str | None:
        return self.data.get("test")

    def entries(self, table: str) -> list[dict]:
        return list(self.data.get(table, []))

    def get_changed_vllm_tests(self) -> list[dict]:
        """vLLM's own tests the packet's fix changes on purpose: {id, why[, fix]}
        (fix: which of the packet's fixes, when not its first)."""
        return [e if isinstance(e, dict) else {"id": e, "why": "see the packet's README"}
                for e in self.data.get("changes_vllm_tests", [])]


def load_packet(folder: Path) -> Packet:
    where = folder / "packet.toml"
    try:
        data = tomllib.loads(where.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PacketError(f"{where}: {exc}") from None
    packet = Packet(folder, data)
    check_packet(packet)
    return packet


def check_packet(packet: Packet) -> None:
    """The packet's structure: every problem is a one-line PacketError."""
    name = f"packet {packet.slug}"
    for key in ("finding", "title", "kind"):
        if not packet.data.get(key):
            raise PacketError(f"{name}: packet.toml lacks {key!r}")
    if packet.kind not in KINDS:
        raise PacketError(f"{name}: kind {packet.kind!r} is not one of {', '.join(KINDS)}")
    if packet.kind in FIXED_KINDS and not packet.fixes:
        raise PacketError(f"{name}: a {packet.kind} packet names the fixes its test needs")
    if packet.kind in ("connector", "no-fix") and packet.fixes:
        raise PacketError(f"{name}: a {packet.kind} packet has no fix (fixes = [])")
    for fix in packet.fixes:
        if not list(FIXES_DIR.glob(f"{fix}.diff")):
            raise PacketError(f"{name}: no fix {fix} ({FIXES_DIR.relative_to(ROOT)}/{fix}.diff)")
    if packet.kind != "history":
        if not packet.test:
            raise PacketError(f"{name}: packet.toml lacks 'test'")
        if not (packet.folder / packet.test).is_file():
            raise PacketError(f"{name}: its test {packet.test} is not in the packet's folder")
    if not (packet.folder / "README.md").is_file():
        raise PacketError(f"{name}: no README.md")


def load_packets(slugs: list[str] | None = None, where: Path = PACKETS) -> list[Packet]:
    folders = sorted(p.parent for p in where.glob("*/packet.toml"))
    packets = [load_packet(f) for f in folders]
    if slugs:
        unknown = set(slugs) - {p.slug for p in packets}
        if unknown:
            raise PacketError(f"no packet {', '.join(sorted(unknown))} "
                              f"(have: {', '.join(p.slug for p in packets)})")
        packets = [p for p in packets if p.slug in slugs]
    return packets


# -- running the tests --------------------------------------------------------------

def get_release(python: str, env: dict) -> str:
    out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise PacketError(f"{python} cannot import vLLM: {tail}")
    return out.stdout.strip()


def get_env(source: vllm_source.VllmSource | None, hf_home: Path) -> dict:
    """The environment a packet's test runs in: the source's ``vllm`` first
    on the path, offline, on the CPU platform, kvspec importable (its plugin)."""
    paths = [str(ROOT)] + ([str(source.root)] if source and not source.is_installed else [])
    env = dict(os.environ, **vllm_source.RUNTIME_ENV, HF_HOME=str(hf_home))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop(vllm_source.SOURCE_ENV, None)
    return env


def run_pytest(python: str, tree: Path, tests: list[str], fixes: str, env: dict,
               junit: Path) -> dict[str, tuple[str, str]]:
    """test path -> (outcome, message), its worst case's, from one pytest run."""
    command = [python, "-m", "pytest", "-q", "-c", "pyproject.toml", "--rootdir", ".",
               "-p", "no:xdist", "-p", "no:cacheprovider", "-p",
               "kvspec.harness.pytest_vllm_fixes", f"--junitxml={junit}", *tests]
    proc = subprocess.run(command, cwd=tree, env=dict(env, KVSPEC_VLLM_FIXES=fixes),
                          capture_output=True, text=True, timeout=1800)
    found = read_junit(junit, tests) if junit.is_file() else {}
    for test in tests:
        if test not in found:  # collection failed: pytest's own last words
            tail = (proc.stdout + proc.stderr).strip().splitlines() or ["no output"]
            found[test] = ("error", tail[-1][:300])
    return found


SEVERITY = ("passed", "skipped", "xfailed", "failed", "error")


def read_junit(junit: Path, tests: list[str]) -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        test = next((t for t in tests if path == t[:-3] or path.startswith(t[:-3] + "/")), None)
        if test is None:
            continue
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                message = (child.get("message") or "").splitlines()[0][:300] \
                    if child.get("message") else ""
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                message = (child.get("message") or "")[:300]
        if test not in found or SEVERITY.index(outcome) > SEVERITY.index(found[test][0]):
            found[test] = (outcome, message)
    return found


def is_failing(outcome: str) -> bool:
    """Only a test that ran and failed shows the bug: an error (a missing
    module, a fixture that broke, a collection failure) shows nothing."""
    return outcome == "failed"


def get_error(runs: dict) -> str | None:
    for label, (outcome, message) in runs.items():
        if outcome == "error":
            return f"{label.replace('_', ' ')}: error, not a verdict: {message}"
    return None


def judge(packet: Packet, runs: dict) -> str | None:
    """Why the packet's test does not behave as its kind says (None: it does)."""
    if error := get_error(runs):
        return error
    released, own, every = (runs[k][0] for k in ("released", "with_its_fixes", "with_every_fix"))
    if not is_failing(released):
        return f"passes as released ({released}): it does not show the bug"
    if packet.kind in FIXED_KINDS:
        if own != "passed":
            return f"with its fixes ({', '.join(packet.fixes)}): {own}"
        if every != "passed":
            return f"with every fix: {every} (the fixes do not combine)"
    elif not (is_failing(own) and is_failing(every)):
        return "passes with kvspec's fixes, but its kind says nothing closes it"
    return None


def install_tests(packets: list[Packet], tree: Path) -> None:
    for packet in packets:
        target = tree / packet.test
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() and target.read_bytes() != (packet.folder / packet.test).read_bytes() \
                and not target.with_name(target.name + ".kvspec-packet").exists():
            raise PacketError(f"{packet.test}: vLLM's tree already has a different file there")
        target.write_bytes((packet.folder / packet.test).read_bytes())
        target.with_name(target.name + ".kvspec-packet").touch()  # ours, to overwrite


def test_command(args) -> int:
    packets = [p for p in load_packets(args.slugs) if p.kind != "history"]
    given = args.vllm or os.environ.get(vllm_source.SOURCE_ENV)
    source = vllm_source.resolve(given) if given else None  # None: PY's own vLLM
    hf_home = CACHE / "hf_home"
    write_cache(hf_home)
    env = get_env(source, hf_home)
    release = get_release(args.python, env)
    label = source.label() if source else f"vLLM {release} installed for {args.python}"
    tree = get_tests(release)
    check_test_imports(args.python, tree, env)
    install_tests(packets, tree)
    tests = [p.test for p in packets]
    print(f"packets: {len(packets)} tests on {label}", file=sys.stderr)
    by_fixes: dict[str, list[str]] = {}
    for p in packets:
        by_fixes.setdefault(",".join(p.fixes) or "none", []).append(p.test)
    runs = [("none", tests, "as released"), ("all", tests, "with every fix")] + [
        (fixes, chosen, "with their fixes") for fixes, chosen in by_fixes.items()
        if fixes != "none"]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        def run(i: int, fixes: str, chosen: list[str], label: str) -> dict:
            print(f"packets: {label}: {len(chosen)} tests, KVSPEC_VLLM_FIXES={fixes}",
                  file=sys.stderr)
            return run_pytest(args.python, tree, chosen, fixes, env, Path(tmp) / f"{i}.xml")
        outcomes = list(pool.map(lambda job: run(job[0], *job[1]), enumerate(runs)))
    released, every = outcomes[0], outcomes[1]
    own = dict(released)  # a packet with no fixes: its own run is the release's
    for found in outcomes[2:]:
        own |= found
    results, bad = {}, []
    for p in packets:
        runs = {"released": released[p.test], "with_its_fixes": own[p.test],
                "with_every_fix": every[p.test]}
        why = judge(p, runs)
        results[p.slug] = {"test": p.test, "kind": p.kind, "fixes": p.fixes,
                           **{k: {"outcome": o, "message": m} for k, (o, m) in runs.items()},
                           "as_its_kind_says": why is None, "why_not": why}
        print(f"packets: {'ok ' if why is None else 'BAD'} {p.slug}: "
              f"released {runs['released'][0]}, with its fixes {runs['with_its_fixes'][0]}, "
              f"with every fix {runs['with_every_fix'][0]}" + (f": {why}" if why else ""),
              file=sys.stderr)
        if why:
            bad.append(p.slug)
    write_results(release, label, results, args.slugs)
    return 1 if bad else 0


def write_results(release: str, label: str, results: dict, partial) -> None:
    path = PACKETS / f"results-{release}.json"
    old = json.loads(path.read_text())["packets"] if partial and path.exists() else {}
    data = {"vllm": release, "source": label,
            "date": datetime.date.today().isoformat(), "kvspec": get_commit(),
            "packets": dict(sorted((old | results).items()))}
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"packets: wrote {path.relative_to(ROOT)}", file=sys.stderr)


def get_commit() -> str:
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


# -- the code a packet names ---------------------------------------------------------

def find_symbol(tree: ast.Module, symbol: str) -> ast.AST | None:
    """The class or function ``symbol`` (``Class.method``) names, at any depth of classes."""
    body, node = tree.body, None
    for part in symbol.split("."):
        node = next((n for n in body if isinstance(
            n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


@attrs.define
class Source:
    """One release's ``vllm`` package, read (never imported)."""

    package: Path
    version: str
    _trees: dict = attrs.Factory(dict)

    def tree(self, file: str) -> ast.Module:
        if file not in self._trees:
            path = self.package.parent / file
            if not path.is_file():
                raise PacketError(f"{file}: not in vLLM {self.version}")
            self._trees[file] = ast.parse(path.read_text())
        return self._trees[file]

    def lines(self, file: str, symbol: str) -> tuple[int, int]:
        node = find_symbol(self.tree(file), symbol)
        if node is None:
            raise PacketError(f"{file}: no {symbol} in vLLM {self.version}")
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return first, node.end_lineno

    def default(self, file: str, symbol: str, name: str):
        """The literal default of field ``name`` of class ``symbol``."""
        node = find_symbol(self.tree(file), symbol)
        for item in getattr(node, "body", []):
            if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == name \
                    and item.value is not None:
                value = item.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "Field":
                    value = next((k.value for k in value.keywords if k.arg == "default"),
                                 value.args[0] if value.args else value)  # pydantic's Field
                try:
                    return ast.literal_eval(value)
                except ValueError:
                    return ast.unparse(value)
        raise PacketError(f"{file}: {symbol} has no field {name} with a default "
                          f"in vLLM {self.version}")

    def enclosing(self, file: str, line: int) -> str:
        return get_enclosing(self.tree(file), line)


def get_enclosing(tree: ast.Module, line: int) -> str:
    """The innermost ``Class.function`` of ``tree`` holding ``line``."""
    best, stack = "(module level)", [(tree.body, "")]
    while stack:
        body, prefix = stack.pop()
        for n in body:
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and n.lineno <= line <= n.end_lineno:
                best = prefix + n.name
                stack.append((n.body, best + "."))
    return best


def get_source(given: str | None) -> Source:
    resolved = vllm_source.resolve(given or os.environ.get(vllm_source.SOURCE_ENV))
    return Source(resolved.package, resolved.version)


def fix_path(fix: str) -> Path:
    return FIXES_DIR / f"{fix}.diff"


def get_changed_lines(fix: str) -> dict[str, tuple[list[int], list[int]]]:
    """file -> (lines the fix's base diff removes, numbered in the release;
    lines it adds, numbered in the patched file). The diff is written against
    the release the packets name (see ``rebase``)."""
    from unidiff import PatchSet
    found: dict[str, tuple[list[int], list[int]]] = {}
    for patched in PatchSet(fix_path(fix).read_text()):
        file = patched.target_file[2:] if patched.target_file.startswith("b/") \
            else patched.target_file
        removed, added = found.setdefault(file, ([], []))
        for hunk in patched:
            # blank lines between methods would name the class itself
            removed += [ln.source_line_no for ln in hunk if ln.is_removed and ln.value.strip()]
            added += [ln.target_line_no for ln in hunk if ln.is_added and ln.value.strip()]
    return found


def get_patched_trees(fix: str, source: "Source", files) -> dict[str, ast.Module]:
    """``files``, which the fix touches, as ``git apply`` leaves them on the release."""
    with tempfile.TemporaryDirectory() as tmp:
        for file in files:
            (Path(tmp) / file).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / file).write_text((source.package.parent / file).read_text())
        out = subprocess.run(["git", "apply", str(fix_path(fix))], cwd=tmp,
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise PacketError(f"{fix}.diff does not apply to vLLM {source.version}: "
                              f"{out.stderr.strip().splitlines()[0]}")
        return {file: ast.parse((Path(tmp) / file).read_text()) for file in files}


def get_changed_functions(fix: str, source: "Source") -> dict[str, dict[str, bool]]:
    """file -> {``Class.function`` a removed or added line lies in: whether the
    fix adds it (absent from the release)}."""
    changed = get_changed_lines(fix)
    patched = get_patched_trees(fix, source, list(changed))
    found: dict[str, dict[str, bool]] = {}
    for file, (removed, added) in changed.items():
        names = {get_enclosing(source.tree(file), n) for n in removed}
        names |= {get_enclosing(patched[file], n) for n in added}
        found[file] = {name: find_symbol(source.tree(file), name) is None
                       and name != "(module level)" for name in names}
    return found


# -- rendering -------------------------------------------------------------------------

def link(ref: str) -> str:
    """``#123`` -> a link to vllm-project/vllm; ``owner/repo#123`` -> its repository."""
    repo, _, number = ref.rpartition("#")
    base = f"https://github.com/{repo}" if repo else UPSTREAM
    return f"[{ref}]({base}/issues/{number})" if number.isdigit() else ref


def code_ref(source: Source, file: str, symbol: str) -> str:
    first, last = source.lines(file, symbol)
    return f"`{file}` `{symbol}` ({first}-{last})"


def render_where(packet: Packet, source: Source) -> list[str]:
    rows = [f"| {code_ref(source, w['file'], w['symbol'])} | {w.get('why', '')} |"
            for w in packet.entries("where")]
    return ["| code (vLLM {0} lines) | why |".format(source.version), "| --- | --- |", *rows] \
        if rows else []


def is_same_default(actual, given) -> bool:
    """``given`` (TOML, possibly with a gloss: "None (no spec decode)") names ``actual``."""
    a, g = str(actual).lower(), str(given).lower()
    return g == a or g.startswith(a + " ")


def render_settings(packet: Packet, source: Source) -> list[str]:
    """A config field's default is read from its class and must be the
    packet's; a setting read in a function (an environment variable) must be
    named in that function's code, and its default is the packet's words."""
    rows = []
    for s in packet.entries("setting"):
        node = find_symbol(source.tree(s["file"]), s["symbol"])
        if isinstance(node, ast.ClassDef):
            actual = source.default(s["file"], s["symbol"], s["name"].split()[0])
            if not is_same_default(actual, s["default"]):
                raise PacketError(f"packet {packet.slug}: {s['name']} defaults to {actual!r} "
                                  f"in vLLM {source.version}, not {s['default']!r}")
            default = f"`{actual!r}` (read from the source)"
        else:
            code = ast.get_source_segment(
                (source.package.parent / s["file"]).read_text(), node) if node else ""
            if s["name"].split()[0] not in (code or ""):
                raise PacketError(f"packet {packet.slug}: {s['file']} {s['symbol']} does not "
                                  f"read {s['name'].split()[0]} in vLLM {source.version}")
            default = s["default"]
        rows.append(f"| `{s['name']}` | {default} | {s['reaches']} | "
                    f"{code_ref(source, s['file'], s['symbol'])} |")
    return ["| setting | default | reaches the bug | where |",
            "| --- | --- | --- | --- |", *rows] if rows else []


def render_exposure(packet: Packet, source: Source) -> list[str]:
    rows = [f"| {e['connector']} | {get_reaches(e['reaches'])} | {e['why']} | "
            f"{code_ref(source, e['file'], e['symbol']) if e.get('file') else ''} |"
            for e in packet.entries("exposure")]
    return ["| in-tree connector | reaches it | why | code |", "| --- | --- | --- | --- |",
            *rows] if rows else []


def get_reaches(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render_upstream(packet: Packet) -> list[str]:
    rows = [f"| {link(u['ref'])} | {u['kind']} | {u['state']} ({u['date']}) | "
            f"{u['relation']} | {u['checked']} |" for u in packet.entries("upstream")]
    return ["| upstream | kind | state (date) | relation | checked |",
            "| --- | --- | --- | --- | --- |", *rows] if rows else \
        ["No upstream issue or pull request found."]


def render_fix(packet: Packet, source: Source) -> list[str]:
    lines = []
    for i, fix in enumerate(packet.fixes):
        where = "; ".join(
            f"`{file}`: " + ", ".join(("new " if is_new else "") + f"`{name}`"
                                      for name, is_new in sorted(funcs.items()))
            for file, funcs in sorted(get_changed_functions(fix, source).items()))
        role = "the fix" if i == 0 else "needed with it"
        lines.append(f"- {role}: [`{fix}.diff`](../../../../kvspec/harness/patches/fixes/"
                     f"{fix}.diff), changing {where}")
    return lines


@functools.cache
def get_replays() -> dict[str, dict]:
    """kvspec's measured replays per release (bench/releases/), read once per run."""
    return load_replays()


@functools.cache
def get_results() -> tuple[dict, ...]:
    """The measured packet runs (results-RELEASE.json), oldest release first, read once."""
    return tuple(json.loads(path.read_text()) for path in sorted(PACKETS.glob("results-*.json")))


def render_releases(packet: Packet) -> list[str]:
    replays = get_replays()
    rows = [row for t in packet.data.get("traces", []) for row in trace_rows(t, replays)]
    if not rows:
        return []
    return [f"kvspec's traces replayed on vLLM {', '.join(replays)} (`bench/releases/`; "
            "other releases were not run), as released and with every fix that fits:", "",
            "| trace | releases | as released | with fixes |", "| --- | --- | --- | --- |",
            *rows]


def render_outcome(packet: Packet) -> list[str]:
    lines = []
    for data in get_results():
        r = data["packets"].get(packet.slug)
        if r is None:
            continue
        fixes = ", ".join(f"`{f}`" for f in r["fixes"]) or "none"
        lines += [f"Measured on vLLM {data['vllm']} ({data['date']}, kvspec {data['kvspec']}):", "",
                  f"- as released: **{r['released']['outcome']}**"
                  + (f": `{r['released']['message']}`" if r['released']['message'] else ""),
                  f"- with its fixes ({fixes}): **{r['with_its_fixes']['outcome']}**",
                  f"- with every kvspec fix: **{r['with_every_fix']['outcome']}**", ""]
    return lines


@functools.cache
def get_gate(release: str) -> dict | None:
    """The last run of vLLM's own tests with every fix (calibrate_vllm_tests.py --fixes)."""
    path = ROOT / "docs" / "calibration" / f"{release}-fixes.json"
    return json.loads(path.read_text()) if path.exists() else None


def render_gate(packet: Packet, release: str) -> list[str]:
    """What vLLM's own suite says of the packet's fixes, and what it could not say."""
    gate = get_gate(release)
    if gate is None or not packet.fixes:
        return []
    mine = sorted(t for t, (fix, _) in gate["contradicted_on_purpose"].items()
                  if fix in packet.fixes)
    broken = gate["broken_by_a_fix"]  # with every fix at once: not split by fix
    unrun = Counter(t.split("::")[0] for t in gate["failed_on_the_release_too"])
    lines = [f"vLLM {release}'s scheduler, prefix-cache and KV-connector tests, {gate['tests']} "
             f"in all, run with every kvspec fix applied "
             f"([`docs/calibration/{release}-fixes.md`](../../../calibration/{release}-fixes.md)):",
             "",
             "- changed on purpose by this packet's fixes: "
             + (", ".join(f"`{t}`" for t in mine) if mine else "none"),
             "- broken by a fix (every fix at once): "
             + (", ".join(f"`{t}`" for t in broken) if broken else "none"),
             f"- not run: {sum(unrun.values())} tests fail on the release too here, so the gate "
             "says nothing about them (multimodal models, whose configs the offline cache lacks "
             "and whose inspection would need torchvision, which does not import beside torch "
             "2.13 here; or a tokenizer, model weights or vLLM's compiled CPU kernels, none of "
             "which the offline gate has; or an accelerator, which Mooncake's worker-side "
             "tests ask for): "
             + ", ".join(f"`{f}` {n}" for f, n in unrun.most_common())]
    return lines


def render_facts(packet: Packet, source: Source) -> str:
    parts = [("The test", [f"`{packet.test}` (in this folder at vLLM's path); "
                           "`python scripts/packets.py test "
                           f"{packet.slug}` runs it.", ""] + render_outcome(packet)
              if packet.test else []),
             ("The fix", render_fix(packet, source)),
             ("vLLM's own tests", render_gate(packet, source.version)),
             ("Where", render_where(packet, source)),
             ("Settings", render_settings(packet, source)),
             ("Exposure", render_exposure(packet, source)),
             ("Upstream", render_upstream(packet)),
             ("Releases", render_releases(packet))]
    body = [BEGIN, "", f"## Facts (generated by `scripts/packets.py render` from vLLM "
            f"{source.version}'s source and kvspec's measurements; do not edit)", ""]
    if packet.not_ready:
        body += [f"**Not ready for upstream:** {packet.not_ready}", ""]
    for heading, lines in parts:
        if lines:
            body += [f"### {heading}", "", *[l for l in lines], ""]
    return "\n".join(body).rstrip("\n") + "\n\n" + END


def rendered_readme(packet: Packet, source: Source) -> str:
    text = (packet.folder / "README.md").read_text()
    head, sep, rest = text.partition(BEGIN)
    if not sep:
        raise PacketError(f"packet {packet.slug}: README.md has no {BEGIN} line")
    _, sep, tail = rest.partition(END)
    if not sep:
        raise PacketError(f"packet {packet.slug}: README.md has no {END} line")
    return head + render_facts(packet, source) + tail


def render_index(packets: list[Packet]) -> str:
    results = {}
    for data in get_results():
        for slug, r in data["packets"].items():
            results[slug] = (data["vllm"], r)
    rows = []
    for p in packets:
        release, r = results.get(p.slug, ("", None))
        measured = (f"{r['released']['outcome']} / {r['with_its_fixes']['outcome']} / "
                    f"{r['with_every_fix']['outcome']} ({release})") if r else "not run"
        ups = p.entries("upstream")
        upstream = ", ".join(f"{link(u['ref'])} {u['state']}" for u in ups[:3]) + (
            f" (+{len(ups) - 3} more)" if len(ups) > 3 else "")
        ready = f"**not ready**: {p.not_ready}" if p.not_ready else "yes"
        rows.append(f"| [{p.data['title']}]({p.slug}/README.md) | {p.kind} | {ready} | "
                    f"{', '.join(f'`{f}`' for f in p.fixes) or '-'} | "
                    f"{f'`{p.test}`' if p.test else '-'} | {measured} | {upstream or 'none found'} |")
    from kvspec.harness.vllm_patches import CONNECTOR_FIXES, FIXES
    held = {f: p for p in packets if p.not_ready for f in p.fixes}
    order = [fid for fid in FIXES | CONNECTOR_FIXES if fix_path(fid).is_file()]
    apply_all = ["", "Every fix of a ready packet at once, in a vLLM 0.33.0 checkout (`git apply` "
                 "takes them in this order; kvspec applies them in the same order):", "",
                 "```bash", *[f"git apply kvspec/harness/patches/fixes/{fid}.diff"
                              for fid in order if fid not in held], "```"]
    apply_all += [f"\nNot for upstream yet: `{fid}` (packet {held[fid].slug} is not ready: "
                  f"{held[fid].not_ready}). kvspec still applies it in its own checks and in "
                  "the gate (it applies after the list above too)."
                  for fid in order if fid in held]
    return "\n".join([INDEX_BEGIN, "",
                      "| packet | kind | ready | fixes | test (vLLM path) | as released / with "
                      "its fixes / with every fix | upstream |",
                      "| --- | --- | --- | --- | --- | --- | --- |", *rows, *apply_all, "", INDEX_END])


def render_command(args) -> int:
    source = get_source(args.vllm)
    packets = load_packets()
    stale = []
    for p in packets:
        new = rendered_readme(p, source)
        path = p.folder / "README.md"
        if new != path.read_text():
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new)
    index = PACKETS / "README.md"
    text = index.read_text()
    head, _, rest = text.partition(INDEX_BEGIN)
    new = head + render_index(packets) + rest.partition(INDEX_END)[2]
    if new != text:
        stale.append(str(index.relative_to(ROOT)))
        if not args.check:
            index.write_text(new)
    if args.check and stale:
        print(f"packets: stale: {', '.join(stale)} (python scripts/packets.py render)",
              file=sys.stderr)
        return 1
    return 0


# -- rebasing the fixes ----------------------------------------------------------------

def fits_exactly(diff_text: str, package: Path) -> bool:
    """Every hunk's old lines occur exactly once in ``package``'s file: ``git
    apply`` takes the diff there (line offsets aside)."""
    from kvspec.harness.hunk_apply import _occurrences
    from unidiff import PatchSet
    for patched in PatchSet(diff_text):
        path = package.parent / patched.source_file[2:]
        lines = path.read_text().splitlines(True) if path.is_file() else []
        for hunk in patched:
            old = [ln.value for ln in hunk if ln.is_context or ln.is_removed]
            if len(_occurrences(lines, old, 0)) != 1:
                return False
    return True


def rebase_command(args) -> int:
    """Each fix's base diff, applied to the source and diffed again: the same
    change with the source's line numbers and context. Where the rebased diff
    no longer fits ``--older`` as written but the old one does, the old one is
    kept as that release's variant (``<fix>@<release>.diff``)."""
    from kvspec.harness.hunk_apply import apply_hunks
    from unidiff import PatchSet
    source = get_source(args.vllm)
    older = get_source(args.older) if args.older else None
    chosen = args.fixes or sorted(p.stem for p in FIXES_DIR.glob("*.diff") if "@" not in p.name)
    for fix in chosen:
        path = fix_path(fix)
        if not path.is_file():
            raise PacketError(f"no fix {fix} ({path.relative_to(ROOT)})")
        old_text, out = path.read_text(), []
        for patched in PatchSet(old_text):
            file = patched.source_file[2:]
            before = (source.package.parent / file).read_text()
            after, drift = apply_hunks(before, list(patched), file)
            for note in drift:
                print(f"packets: {path.name}: {note}", file=sys.stderr)
            out += difflib.unified_diff(before.splitlines(True), after.splitlines(True),
                                        f"a/{file}", f"b/{file}", n=3)
        text = "".join(out)
        if text == old_text:
            continue
        if older and not fits_exactly(text, older.package) and fits_exactly(old_text, older.package):
            keep = FIXES_DIR / f"{fix}@{older.version}.diff"
            if not keep.exists():
                keep.write_text(old_text)
                print(f"packets: kept the old diff as {keep.name}", file=sys.stderr)
        path.write_text(text)
        print(f"packets: rebased {path.name} on vLLM {source.version}", file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("test", help="run the packets' tests on a release")
    t.add_argument("slugs", nargs="*")
    t.add_argument("--python", default=sys.executable,
                   help="the Python to run vLLM's tests with (its vLLM, or --vllm over it)")
    t.add_argument("--vllm", help="a vLLM source to put first on the path")
    t.add_argument("--jobs", type=int, default=2, help="pytest processes at once")
    r = sub.add_parser("render", help="write the packets' generated facts and the index")
    r.add_argument("--vllm")
    r.add_argument("--check", action="store_true")
    b = sub.add_parser("rebase", help="rewrite the fixes' line numbers against a source")
    b.add_argument("fixes", nargs="*", help="fix ids (default: every base diff)")
    b.add_argument("--vllm")
    b.add_argument("--older", help="a release the diffs must still fit as written "
                   "(the old diff is kept as its variant where the rebased one does not)")
    args = parser.parse_args()
    try:
        return {"test": test_command, "render": render_command,
                "rebase": rebase_command}[args.command](args)
    except (PacketError, vllm_source.SourceError) as exc:
        print(f"packets: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
