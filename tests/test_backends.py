"""AmpPrecision's backends are pluggable: without the apex backend's module and its registry line, the package
still imports, and the native backend passes its tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import CPU_FP16_MISSING

import lightning_ddp_amp

ROOT = Path(__file__).parent.parent
#: The apex backend's one line in the registry of lightning_ddp_amp/amp/backend.py.
APEX_REGISTRATION = '    "apex": "lightning_ddp_amp.amp.apex_backend:ApexAmp",\n'
#: The native backend's tests: these files, less the tests that use the apex double (deselected by the plugin
#: below) and the five that need the apex backend itself: three name it in a message, two fall back from it.
NATIVE_TESTS = (
    "tests/test_precision.py",
    "tests/test_torch_features.py",
    "tests/test_ddp_under_amp.py",
    "--deselect=tests/test_precision.py::test_bad_argument_names_the_field_its_value_and_the_fix[{'backend': 'cuda'}]",
    "--deselect=tests/test_precision.py::test_apex_not_installed_says_where_apex_amp_exists_and_the_native_alternatives",
    "--deselect=tests/test_precision.py::test_falling_back_to_native_prints_one_line_with_the_mapping",
    "--deselect=tests/test_precision.py::test_falling_back_with_a_fixed_loss_scale_names_the_scale",
    "--deselect=tests/test_precision.py::test_apex_on_a_machine_without_cuda_says_so_and_points_at_amp_first",
)
#: Run in the subprocess: check that the copy, not the checkout, is what the tests import, then run them.
CHECK_THEN_TEST = """
import sys, pytest, lightning_ddp_amp, lightning_ddp_amp.trainer.precision as precision
assert lightning_ddp_amp.__file__.startswith(sys.argv[1]), lightning_ddp_amp.__file__
assert precision.BACKENDS == ("auto", "native"), precision.BACKENDS

class WithoutApexDouble:
    def pytest_collection_modifyitems(self, config, items):
        apex = [item for item in items if {"apex_double", "apex_without_amp"} & set(item.fixturenames)]
        config.hook.pytest_deselected(items=apex)
        items[:] = [item for item in items if item not in apex]

sys.exit(pytest.main(sys.argv[2:], plugins=[WithoutApexDouble()]))
"""


def package_without_apex_backend(folder: Path) -> Path:
    """A copy of the package in ``folder`` with the apex backend's module and registry line deleted."""
    package = folder / "lightning_ddp_amp"
    shutil.copytree(Path(lightning_ddp_amp.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "amp" / "apex_backend.py").unlink()
    registry = package / "amp" / "backend.py"
    text = registry.read_text()
    assert text.count(APEX_REGISTRATION) == 1, "the apex backend is no longer registered by one line"
    registry.write_text(text.replace(APEX_REGISTRATION, ""))
    return package


def test_the_native_backend_passes_its_tests_without_the_apex_backend(tmp_path: Path) -> None:
    copy = tmp_path / "native_only"
    package_without_apex_backend(copy)
    env = {**os.environ, "PYTHONPATH": str(copy)}
    arguments = ["-q", "-rs", "-p", "no:randomly", "-p", "no:cacheprovider", *NATIVE_TESTS]
    result = subprocess.run(
        [sys.executable, "-c", CHECK_THEN_TEST, str(copy), *arguments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    passed = int(summary.split(" passed")[0].split()[-1])
    # A torch before 2.3 skips the tests that compute in float16 on the CPU (conftest.needs_cpu_fp16), saying why.
    skipped_without_cpu_fp16 = sum(
        int(count)
        for count, reason in re.findall(r"^SKIPPED \[(\d+)\] .*?: (.*)$", result.stdout, re.MULTILINE)
        if reason == CPU_FP16_MISSING
    )
    assert passed + skipped_without_cpu_fp16 >= 80, summary
