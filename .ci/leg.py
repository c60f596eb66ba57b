"""Checks one CI leg: the versions it runs, then (after pytest) that enough tests passed.

    python .ci/leg.py versions torch==2.1.2 "numpy<2" lightning==2.5.0 pytorch-lightning==2.5.0
    python .ci/leg.py passed REPORT.xml MINIMUM

Run by the leg's own interpreter, so that it reads what the leg imports. ``versions`` ignores local version labels
(2.13.0+cpu is torch==2.13.0). ``passed`` reads pytest's --junitxml report: a leg that collected nothing, or far fewer tests
than it should, fails instead of passing quietly.
"""

from __future__ import annotations

import importlib.metadata
import sys
import xml.etree.ElementTree as ET

from packaging.requirements import Requirement


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


def passed(report: str, minimum: int) -> int:
    suites = ET.parse(report).getroot()
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    ok = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    summary = f"{ok} passed, {counts['skipped']} skipped, {counts['failures'] + counts['errors']} failed"
    if ok < minimum or counts["failures"] or counts["errors"]:
        print(f"leg tests: {summary}; at least {minimum} must pass and none fail ({report})", file=sys.stderr)
        return 1
    print(f"leg tests: {summary} (at least {minimum} must pass)")
    return 0


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    sys.exit(versions(args) if command == "versions" else passed(args[0], int(args[1])))
