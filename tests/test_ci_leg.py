"""CI's per-file floors (.ci/leg.py with .ci/minimums.toml): a leg fails when a test file stops passing its tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

CI = Path(__file__).parents[1] / ".ci"
LEGS = ("test", "test-lowest", "test-torch21", "test-newest")


def _leg_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_leg", CI / "leg.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


leg = _leg_module()


def write_report(path: Path, passed: dict[str, int], skipped: dict[str, int] | None = None) -> Path:
    """A junit report as pytest writes it: ``passed[file]`` passing and ``skipped[file]`` skipped cases per file."""
    suites = ET.Element("testsuites")
    suite = ET.SubElement(suites, "testsuite", name="pytest")
    for counts, outcome in ((passed, None), (skipped or {}, "skipped")):
        for file, count in counts.items():
            classname = file.removesuffix(".py").replace("/", ".")
            for index in range(count):
                case = ET.SubElement(suite, "testcase", classname=classname, name=f"test_{outcome}_{index}")
                if outcome:
                    ET.SubElement(case, outcome, message="needs something")
    ET.ElementTree(suites).write(path)
    return path


def run_passed(report: Path, leg_name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CI / "leg.py"), "passed", str(report), leg_name],
        capture_output=True,
        text=True,
        timeout=60,
    )


def floors(leg_name: str) -> dict[str, int]:
    table: dict[str, int] = tomllib.loads((CI / "minimums.toml").read_text())[leg_name]["passed"]
    return table


def report_at_floors(path: Path, leg_name: str, without: str | None = None) -> Path:
    """A report of the leg at its floors: each file passes its floor, one skipped test stands in for a file whose
    floor is 0 (all its tests skip on that leg), and ``without`` was not collected."""
    passed = {file: count for file, count in floors(leg_name).items() if file != without}
    return write_report(path, passed, {file: 1 for file, count in passed.items() if count == 0})


@pytest.mark.parametrize("leg_name", LEGS)
def test_every_leg_has_floors_for_existing_test_files(leg_name: str) -> None:
    table = floors(leg_name)
    assert sum(table.values()) > 0, f"no floors for leg {leg_name}"
    for file in table:
        assert (CI.parent / file).is_file(), file


@pytest.mark.parametrize("leg_name", LEGS)
def test_a_report_at_every_floor_passes_the_leg(tmp_path: Path, leg_name: str) -> None:
    result = run_passed(report_at_floors(tmp_path / "report.xml", leg_name), leg_name)
    assert result.returncode == 0, result.stderr
    assert "every file at or above its floor" in result.stdout


def test_a_report_missing_one_test_file_fails_the_leg_naming_that_file(tmp_path: Path) -> None:
    result = run_passed(report_at_floors(tmp_path / "report.xml", "test", without="tests/test_precision.py"), "test")
    assert result.returncode == 1
    assert result.stderr.count("  - ") == 1, result.stderr
    floor = floors("test")["tests/test_precision.py"]
    assert (
        f"tests/test_precision.py: at least {floor} test(s) must pass on leg test, but it was not collected at all"
        in result.stderr
    )


def test_a_listed_file_whose_tests_all_skip_must_still_be_collected(tmp_path: Path) -> None:
    assert floors("test")["tests/test_cuda.py"] == 0  # every test there needs a GPU
    result = run_passed(report_at_floors(tmp_path / "report.xml", "test", without="tests/test_cuda.py"), "test")
    assert result.returncode == 1
    assert "tests/test_cuda.py: at least 0 test(s) must pass on leg test, but it was not collected at all" in (
        result.stderr
    )


def test_a_file_passing_fewer_tests_than_its_floor_fails_the_leg(tmp_path: Path) -> None:
    counts = floors("test-torch21")
    file = next(file for file, count in counts.items() if count > 0)
    counts[file] -= 1
    result = run_passed(write_report(tmp_path / "report.xml", counts, {file: 1}), "test-torch21")
    assert result.returncode == 1
    assert f"{file}: at least {counts[file] + 1} test(s) must pass on leg test-torch21, but {counts[file]} passed" in (
        result.stderr
    )


def test_more_skips_than_the_leg_allows_fail_it(tmp_path: Path) -> None:
    limit = tomllib.loads((CI / "minimums.toml").read_text())["test"]["max_skipped"]
    result = run_passed(
        write_report(tmp_path / "report.xml", floors("test"), {"tests/test_cuda.py": limit + 1}), "test"
    )
    assert result.returncode == 1
    assert f"{limit + 1} tests skipped on leg test, at most {limit} may" in result.stderr


def test_a_test_file_without_a_floor_fails_the_leg(tmp_path: Path) -> None:
    counts = {**floors("test-newest"), "tests/test_brand_new.py": 3}
    result = run_passed(write_report(tmp_path / "report.xml", counts), "test-newest")
    assert result.returncode == 1
    assert result.stderr.count("  - ") == 1, result.stderr
    assert "tests/test_brand_new.py ran 3 test(s) but minimums.toml has no floor for it on leg test-newest" in (
        result.stderr
    )


def test_a_failed_test_fails_the_leg_even_above_every_floor(tmp_path: Path) -> None:
    report = report_at_floors(tmp_path / "report.xml", "test")
    tree = ET.parse(report)
    suite = tree.getroot().find("testsuite")
    assert suite is not None
    case = ET.SubElement(suite, "testcase", classname="tests.test_data", name="test_broken")
    ET.SubElement(case, "failure", message="assert False")
    tree.write(report)
    result = run_passed(report, "test")
    assert result.returncode == 1
    assert result.stderr.count("  - ") == 1, result.stderr
    assert "failed: tests/test_data.py::test_broken" in result.stderr


def test_class_based_and_nested_classnames_map_to_their_file() -> None:
    assert leg.file_of("tests.test_data.TestShards") == "tests/test_data.py"
    assert leg.file_of("tests.test_data") == "tests/test_data.py"


def test_record_writes_floors_that_the_same_report_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leg, "MINIMUMS", tmp_path / "minimums.toml")
    report = write_report(tmp_path / "report.xml", {"tests/test_a.py": 4, "tests/test_b.py": 2}, {"tests/test_b.py": 1})
    assert leg.record(str(report), "test-lowest") == 0
    assert tomllib.loads((tmp_path / "minimums.toml").read_text()) == {
        "test-lowest": {"max_skipped": 1, "passed": {"tests/test_a.py": 4, "tests/test_b.py": 2}}
    }
    assert leg.passed(str(report), "test-lowest") == 0
