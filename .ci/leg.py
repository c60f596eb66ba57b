"""Checks one CI leg: the versions it runs, then (after pytest) what passed, file by file.

    python .ci/leg.py versions torch==2.1.2 "numpy<2" lightning==2.5.0 pytorch-lightning==2.5.0
    python .ci/leg.py passed REPORT.xml LEG
    python .ci/leg.py record REPORT.xml LEG

Run by the leg's own interpreter, so that it reads what the leg imports. ``versions`` ignores local version labels
(2.13.0+cpu is torch==2.13.0).

``passed`` reads pytest's --junitxml report and the leg's table in ``.ci/minimums.toml``: every test file listed
there must pass at least its number of tests, no file may run that the table does not list, the leg may skip at
most ``max_skipped`` tests, and nothing may fail. So a test file that stops being collected, or a probe that starts
skipping what used to run, fails the leg instead of passing quietly. ``record`` writes the leg's table from a
report (the counts a maintainer checks in when tests are added or removed).
"""

from __future__ import annotations

import importlib.metadata
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

#: The per-leg floors: ``[LEG] max_skipped = N`` and ``[LEG.passed] "tests/test_x.py" = N``.
MINIMUMS = Path(__file__).with_name("minimums.toml")


def versions(pins: list[str]) -> int:
    wrong = []
    for pin in pins:
        requirement = Requirement(pin)
        found = importlib.metadata.version(requirement.name)
        if not requirement.specifier.contains(found, prereleases=True):
            wrong.append(f"{requirement.name} {found} (the leg pins {requirement.specifier})")
    if wrong:
        print(f"leg versions: wrong {', '.join(wrong)}", file=sys.stderr)
        return 1
    found = ", ".join(f"{Requirement(pin).name} {importlib.metadata.version(Requirement(pin).name)}" for pin in pins)
    print(f"leg versions: {found}")
    return 0


@dataclass
class Outcomes:
    """What one pytest report says: passes and skips per test file, and the failures."""

    passed: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)


def file_of(classname: str) -> str:
    """The test file of a junit ``classname``: ``tests.test_data.TestX`` is ``tests/test_data.py``."""
    parts = classname.split(".")
    module = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
    return "/".join(parts[: module + 1]) + ".py"


def read_report(report: str | Path) -> Outcomes:
    outcomes = Outcomes()
    for case in ET.parse(report).getroot().iter("testcase"):
        path = file_of(case.get("classname", ""))
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes.failed.append(f"{path}::{case.get('name')}")
        elif case.find("skipped") is not None:
            outcomes.skipped[path] += 1
        else:
            outcomes.passed[path] += 1
    return outcomes


def problems(outcomes: Outcomes, table: dict[str, object], leg: str) -> list[str]:
    """Everything about ``outcomes`` that the leg's ``table`` does not allow, one sentence each."""
    floors: dict[str, int] = table.get("passed", {})  # type: ignore[assignment]
    found = []
    for path in sorted(set(floors) | set(outcomes.passed) | set(outcomes.skipped)):
        ran = outcomes.passed[path] + outcomes.skipped[path]
        if path not in floors:
            found.append(
                f"{path} ran {ran} test(s) but {MINIMUMS.name} has no floor for it on leg {leg}: add it (`python"
                f" .ci/leg.py record REPORT {leg}` writes today's counts)"
            )
        elif ran == 0:  # also for a floor of 0: a file whose tests all skip here must still be collected
            found.append(
                f"{path}: at least {floors[path]} test(s) must pass on leg {leg}, but it was not collected at all"
            )
        elif outcomes.passed[path] < floors[path]:
            found.append(
                f"{path}: at least {floors[path]} test(s) must pass on leg {leg}, but {outcomes.passed[path]} passed"
            )
    limit = int(table.get("max_skipped", 0))  # type: ignore[call-overload]
    total_skipped = sum(outcomes.skipped.values())
    if total_skipped > limit:
        found.append(f"{total_skipped} tests skipped on leg {leg}, at most {limit} may (see pytest's -ra summary)")
    found += [f"failed: {name}" for name in outcomes.failed]
    return found


def passed(report: str, leg: str) -> int:
    outcomes = read_report(report)
    tables = tomllib.loads(MINIMUMS.read_text())
    if leg not in tables:
        print(f"leg tests: {MINIMUMS} has no table [{leg}]", file=sys.stderr)
        return 1
    found = problems(outcomes, tables[leg], leg)
    summary = (
        f"{sum(outcomes.passed.values())} passed, {len(outcomes.failed)} failed,"
        f" {sum(outcomes.skipped.values())} skipped in {len(outcomes.passed | outcomes.skipped)} files"
    )
    if found:
        print(f"leg tests: {summary} ({report}); against {MINIMUMS}:", file=sys.stderr)
        for line in found:
            print(f"  - {line}", file=sys.stderr)
        return 1
    print(f"leg tests: {summary}: every file at or above its floor in {MINIMUMS.name} [{leg}]")
    return 0


def record(report: str, leg: str) -> int:
    outcomes = read_report(report)
    if outcomes.failed:
        print(f"leg record: {len(outcomes.failed)} test(s) failed; record from a green run", file=sys.stderr)
        return 1
    tables = tomllib.loads(MINIMUMS.read_text()) if MINIMUMS.exists() else {}
    files = sorted(set(outcomes.passed) | set(outcomes.skipped))
    tables[leg] = {
        "max_skipped": sum(outcomes.skipped.values()),
        "passed": {path: outcomes.passed[path] for path in files},
    }
    MINIMUMS.write_text(_render(tables))
    print(f"leg record: [{leg}] {sum(outcomes.passed.values())} passed in {len(files)} files -> {MINIMUMS}")
    return 0


def _render(tables: dict[str, dict[str, object]]) -> str:
    lines = [
        "# CI's floor for each leg (.ci/leg.py): every test file must pass at least its number of tests, no other file",
        "# may run, and the leg may skip at most max_skipped. Written by `python .ci/leg.py record REPORT LEG` from a",
        "# green run of that leg (its report is build/test-reports/LEG.xml); a commit that adds or removes tests",
        "# records the legs that run them.",
    ]
    for leg, table in tables.items():
        lines += ["", f"[{leg}]", f"max_skipped = {table['max_skipped']}", "", f"[{leg}.passed]"]
        lines += [f'"{path}" = {count}' for path, count in table["passed"].items()]  # type: ignore[attr-defined]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "versions":
        sys.exit(versions(args))
    sys.exit({"passed": passed, "record": record}[command](args[0], args[1]))
