"""kvspec's fixes installed into the installed classes (``kvspec/harness/in_place.py``):
a subclass defined before the install, an ``isinstance`` on the installed class
and ``super()`` inside a fixed method all see the fix; what no fix touched stays
as it was; the undo puts everything back. Built on a throwaway module, the way
``vllm_patches.build`` executes a patched copy of a vLLM module."""
from __future__ import annotations

import sys
import textwrap
import types

import pytest

from kvspec.harness.in_place import InPlace

SOURCE = textwrap.dedent('''
    LIMIT = 3

    class Base:
        def size(self):
            return 1

    class Scheduler(Base):
        def schedule(self):
            return "released"

        def size(self):
            return super().size() + 1

        def untouched(self):
            return "same"

        @property
        def name(self):
            return "scheduler"

    def helper():
        return "released"
''')

FIXED = SOURCE.replace('return "released"\n\n    def size',
                       'return fixed_helper()\n\n    def size') \
              .replace("return super().size() + 1", "return super().size() + 10") \
              .replace('return "scheduler"', 'return "fixed " + str(LIMIT)') \
              + "\ndef fixed_helper():\n    return 'fixed'\n"


def load(name: str, text: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(text, name, "exec"), module.__dict__)  # noqa: S102 - the test's own text
    return module


@pytest.fixture
def installed():
    module = load("kvspec_in_place_demo", SOURCE)
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_every_subclass_and_isinstance_sees_the_fix(installed):
    class Async(installed.Scheduler):  # defined before the fix, like AsyncScheduler
        pass
    s = Async()
    plan = InPlace.of({installed.__name__: load(installed.__name__, FIXED)})
    undo = plan.install()
    assert s.schedule() == "fixed" and s.size() == 11 and s.name == "fixed 3"
    assert isinstance(s, installed.Scheduler) and installed.fixed_helper() == "fixed"
    assert plan.get_names() == ["Scheduler.name", "Scheduler.schedule", "Scheduler.size",
                                "kvspec_in_place_demo.fixed_helper"]
    undo()
    assert s.schedule() == "released" and s.size() == 2 and s.name == "scheduler"
    assert not hasattr(installed, "fixed_helper")


def test_an_identical_copy_changes_nothing(installed):
    assert InPlace.of({installed.__name__: load(installed.__name__, SOURCE)}).edits == []
