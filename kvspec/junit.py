"""A run as JUnit XML, the report CI systems read (issue 28, item 2).

One test case per claim of the registry (and per outcome a run can end in,
such as ``target_crashed``), named ``<target>::<claim>``: a failure when the
run's new counterexample violates it, skipped when the claim was not checked
(a design rule with ``--no-design-rules``), a pass otherwise. Each case
carries how often the claim was checked and witnessed as properties, so a
claim that held only because it was never witnessed is visible in CI. An
interrupted run is one error case, ``<target>::run``: its claims were judged
only up to the interrupt. Built from ``kvspec.report.json_summary``, so the
JUnit file and ``--json`` never disagree.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from kvspec.verdict import EXIT_INTERRUPTED


def _properties(parent: ET.Element, values: dict) -> None:
    props = ET.SubElement(parent, "properties")
    for name, value in values.items():
        ET.SubElement(props, "property", name=name, value="" if value is None else str(value))


def get_replay_command(summary: dict) -> str:
    """The command that replays a run's saved trace (every report prints it)."""
    return f"kvspec replay {summary['trace']} --target '{summary['target']}'"


def _claim_case(suite: ET.Element, summary: dict, claim: dict) -> str:
    case = ET.SubElement(suite, "testcase", classname=f"kvspec.{summary['target']}",
                         name=f"{summary['target']}::{claim['name']}", time="0")
    _properties(case, {"kind": claim["kind"], "role": claim["role"],
                       "checked": claim["checked"], "witnessed": claim["witnessed"]})
    if claim["violations"]:
        messages = [v["message"] for v in summary["violations"] if v["claim"] == claim["name"]]
        failure = ET.SubElement(case, "failure", type="violation",
                                message=(messages[0] if messages else claim["name"])[:500])
        failure.text = "\n".join(messages + [f"trace: {summary['trace']}",
                                             f"replay: {get_replay_command(summary)}"])
        return "failure"
    if claim["checked"] is None and claim["kind"] != "outcome":
        ET.SubElement(case, "skipped", message="not checked in this run (a design rule "
                                               "turned off)")
        return "skipped"
    return "passed"


def junit_xml(summary: dict) -> str:
    """The JUnit document of one ``check``/``fuzz`` run (its ``json_summary``)."""
    suites = ET.Element("testsuites")
    suite = ET.SubElement(suites, "testsuite", name=f"kvspec {summary['target']}",
                          time=f"{summary['elapsed_s']:.3f}")
    # a run's budget is seconds or runs (--examples), never both
    budget = ({"examples_budget": summary["examples_budget"]}
              if summary.get("examples_budget") is not None else
              {"budget_s": summary["budget_s"]})
    _properties(suite, {"verdict": summary["verdict_line"], "exit_code": summary["exit_code"],
                        "seed": summary["seed"], **budget,
                        "runs": summary["runs"], "actions": summary["actions"],
                        "version": summary["version"], "trace": summary["trace"]})
    outcomes = [_claim_case(suite, summary, c) for c in summary["claims"]]
    errors = 0
    if summary["exit_code"] == EXIT_INTERRUPTED:
        case = ET.SubElement(suite, "testcase", classname=f"kvspec.{summary['target']}",
                             name=f"{summary['target']}::run", time="0")
        ET.SubElement(case, "error", type="interrupted", message=summary["verdict_line"][:500])
        errors = 1
    suite.set("tests", str(len(outcomes) + errors))
    suite.set("failures", str(outcomes.count("failure")))
    suite.set("skipped", str(outcomes.count("skipped")))
    suite.set("errors", str(errors))
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(path: Path, summary: dict) -> None:
    """Written whole or not at all: a CI step never reads half a file."""
    partial = path.with_name(path.name + ".part")
    partial.write_text(junit_xml(summary))
    partial.replace(path)
