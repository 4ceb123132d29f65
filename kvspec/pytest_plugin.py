"""kvspec's checker as ordinary pytest items in a user's own suite (issue 28, item 1).

Installed with kvspec (entry point ``pytest11``), inert until asked for::

    pytest --kvspec [--kvspec-target impl] [--kvspec-target vllm]
           [--kvspec-budget 120s] [--kvspec-layouts full,sliding] [--kvspec-vllm PATH]

adds one item per target and layout, ``kvspec::<target>[<layout>]``, each the default
check (``kvspec check``) run in its own process: vLLM is imported there, never into the
user's test process, and an item's seed, budget and layouts are the command's. An item
passes when the check holds, fails on a new violation with the step table and the
command that replays the saved trace, and fails too when the check could not finish
(a crash of the checker, a budget spent before any run). Known findings of the vLLM
under test are reported as the check reports them and do not fail the item.

Each item carries markers to select by (``pytest --kvspec -m "kvspec_impl"``):
``kvspec``, ``kvspec_<target kind>`` (``kvspec_impl``, ``kvspec_vllm``,
``kvspec_mutant``) and ``kvspec_layout_<layout>`` (``sliding+state`` is
``kvspec_layout_sliding_state``). The claims' witnessed counts and the trace go into
the item's ``user_properties``, so ``--junitxml`` carries them.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.parallel import read_summary
from kvspec.verdict import EXIT_HOLD, EXIT_INTERRUPTED


def pytest_addoption(parser) -> None:
    group = parser.getgroup("kvspec", "kvspec: vLLM's KV-cache request lifecycle, checked")
    group.addoption("--kvspec", action="store_true", default=False,
                    help="add kvspec's default check as test items (one per target and layout)")
    group.addoption("--kvspec-target", action="append", default=None, metavar="TARGET",
                    help="target to check (repeatable; default: impl). See `kvspec targets`.")
    group.addoption("--kvspec-budget", default=None, metavar="BUDGET",
                    help="time budget of each item, shrinking included (default: 60s; "
                         "or --kvspec-examples)")
    group.addoption("--kvspec-seed", default=0, type=int, metavar="SEED",
                    help="seed of every item (default: 0)")
    group.addoption("--kvspec-examples", default=None, type=int, metavar="N",
                    help="a budget of N runs instead of --kvspec-budget: the same "
                         "exploration on any machine")
    group.addoption("--kvspec-time-limit", default=None, metavar="DURATION",
                    help="with --kvspec-examples: each item's wall-clock safety net (30m); "
                         "an item it stops with nothing found fails as incomplete")
    group.addoption("--kvspec-layouts", default=None, metavar="LAYOUTS",
                    help="KV cache group layouts joined by commas, one item each "
                         "(default: one item drawing every layout the target maps)")
    group.addoption("--kvspec-vllm", default=None, metavar="PATH",
                    help="the vLLM to check on a vllm target (a checkout, wheel or sdist)")
    group.addoption("--kvspec-out", default=".kvspec/failures", metavar="DIR",
                    help="where failing traces are saved (default: .kvspec/failures)")
    group.addoption("--kvspec-markdown", default=None, metavar="PATH",
                    help="write every item's result as Markdown there (a pull-request "
                         "comment or CI job summary)")


def pytest_configure(config) -> None:
    for name, what in (("kvspec", "a kvspec check item"),
                       ("kvspec_impl", "kvspec on the reference implementation"),
                       ("kvspec_vllm", "kvspec on vLLM's scheduler"),
                       ("kvspec_mutant", "kvspec on a mutant of the reference")):
        config.addinivalue_line("markers", f"{name}: {what}")
    if config.getoption("--kvspec", default=False):
        for _, layout in get_items_wanted(config):
            config.addinivalue_line("markers", f"kvspec_layout_{get_marker_name(layout or 'all')}"
                                               f": kvspec items drawing {layout or 'every'} layout")


MARKDOWN_KEY = pytest.StashKey[list]()


def pytest_sessionfinish(session, exitstatus) -> None:
    """Write the Markdown summary. Under pytest-xdist each worker leaves its
    items' parts beside the file and the controller, which finishes last,
    gathers them."""
    config = session.config
    path = config.getoption("--kvspec-markdown", default=None)
    if not (path and config.getoption("--kvspec", default=False)):
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = config.stash.get(MARKDOWN_KEY, [])
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is not None:
        path.with_name(f"{path.name}.{worker}.part").write_text("\n".join(parts), "utf-8")
        return
    for part in sorted(path.parent.glob(f"{path.name}.*.part")):
        parts.append(part.read_text("utf-8"))
        part.unlink()
    head = ["## kvspec", ""] if any(parts) else ["## kvspec", "", "No kvspec item ran.", ""]
    path.write_text("\n".join(head + [p for p in parts if p]), encoding="utf-8")


def get_marker_name(text: str) -> str:
    """``sliding+state`` -> ``sliding_state``: a name ``-m`` can select."""
    return re.sub(r"[^0-9A-Za-z_]+", "_", text).strip("_")


def get_items_wanted(config) -> list[tuple[str, str | None]]:
    targets = config.getoption("--kvspec-target") or ["impl"]
    layouts = config.getoption("--kvspec-layouts")
    chosen = [x.strip() for x in layouts.split(",") if x.strip()] if layouts else [None]
    return [(target, layout) for target in targets for layout in chosen]


def pytest_collection_modifyitems(session, config, items) -> None:
    if not config.getoption("--kvspec"):
        return
    parent = KvspecCollector.from_parent(session, name="kvspec", nodeid="kvspec")
    for target, layout in get_items_wanted(config):
        item = KvspecItem.from_parent(parent, name=f"{target}[{layout or 'all'}]",
                                      target=target, layout=layout)
        kind = target.split(":", 1)[0].split("?", 1)[0]
        for marker in ("kvspec", f"kvspec_{get_marker_name(kind)}",
                       f"kvspec_layout_{get_marker_name(layout or 'all')}"):
            item.add_marker(marker)
        items.append(item)


class KvspecCollector(pytest.Collector):
    """The parent of kvspec's items: their ids read ``kvspec::<target>[<layout>]``
    and JUnit files file them under the class ``kvspec``."""

    def collect(self):
        return []  # the items are made from the options, not collected from a file


class KvspecFailure(Exception):
    """A check that did not hold; the message is the report pytest prints."""


class KvspecItem(pytest.Item):
    def __init__(self, *, target: str, layout: str | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.target, self.layout = target, layout

    def get_command(self) -> list[str]:
        opt = self.config.getoption
        command = [sys.executable, "-m", "kvspec", "check", "--target", self.target,
                   "--seed", str(opt("--kvspec-seed")), "--out", opt("--kvspec-out"), "--json"]
        examples, budget = opt("--kvspec-examples"), opt("--kvspec-budget")
        # a budget in runs replaces the time budget (both given: check refuses, one line)
        if budget is not None or examples is None:
            command += ["--budget", budget or "60s"]
        if examples is not None:
            command += ["--examples", str(examples)]
        if opt("--kvspec-time-limit") is not None:
            command += ["--time-limit", opt("--kvspec-time-limit")]
        if self.layout:
            command += ["--layouts", self.layout]
        if opt("--kvspec-vllm") and self.target.startswith("vllm"):
            command += ["--vllm", opt("--kvspec-vllm")]  # the vllm targets' source only
        return command

    def runtest(self) -> None:
        command = self.get_command()
        env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              cwd=self.config.rootpath)
        summary = read_summary(done.stdout)
        self.record(summary)
        self.config.stash.setdefault(MARKDOWN_KEY, []).append(
            get_markdown(self.name, done, summary))
        if done.returncode == EXIT_INTERRUPTED:
            pytest.exit(f"kvspec: {self.name} was interrupted", returncode=EXIT_INTERRUPTED)
        if done.returncode != EXIT_HOLD or summary is None:
            raise KvspecFailure(render_failure(command, done, summary))

    def record(self, summary: dict | None) -> None:
        if summary is None:
            return
        self.user_properties += [("verdict", summary["verdict_line"]),
                                 ("seed", summary["seed"]), ("runs", summary["runs"]),
                                 ("actions", summary["actions"])]
        if summary.get("trace"):
            self.user_properties.append(("trace", summary["trace"]))
        for claim in summary["claims"]:
            if claim["kind"] != "outcome":
                self.user_properties.append(
                    (f"witnessed:{claim['name']}", claim["witnessed"]))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, KvspecFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.config.rootpath, None, self.name


def get_markdown(name: str, done, summary: dict | None) -> str:
    if summary is None:
        return (f"### {name}: the check crashed (exit {done.returncode})\n\n```\n"
                + "\n".join(done.stderr.strip().splitlines()[-15:]) + "\n```\n")
    from kvspec.markdown_summary import markdown_summary
    return markdown_summary(summary)


def get_counterexample_text(stderr: str) -> str:
    """The step table of the check's human output, and what follows it (the
    violated claim, its docstring, where the trace was saved)."""
    lines = stderr.splitlines()
    table = next((i for i, ln in enumerate(lines) if ln.strip() == "counterexample"), None)
    return "\n".join(lines[table:]) if table is not None else "\n".join(lines[-15:])


def render_failure(command: list[str], done, summary: dict | None) -> str:
    shown = " ".join(shlex.quote(c) for c in command[1:]).replace("-m kvspec", "kvspec", 1)
    if summary is None:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        return f"kvspec check crashed (exit {done.returncode}): {shown}\n{tail}"
    lines = [f"{summary['verdict_line']} (exit {done.returncode})", f"ran: {shown}"]
    if summary.get("trace"):
        from kvspec.junit import get_replay_command
        lines.append(f"replay: {get_replay_command(summary)}")
    return "\n".join(lines + ["", get_counterexample_text(done.stderr)])
