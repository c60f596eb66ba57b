"""The examples in examples/ run as the README says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Torchrun, check, worker_env

EXAMPLES = Path(__file__).parents[1] / "examples"

pytestmark = pytest.mark.multiprocess


def test_demo_trains_on_two_ranks_under_torchrun(torchrun: Torchrun) -> None:
    # Torchrun.start resolves scripts against tests/workers; an absolute path is taken as is.
    result = check(torchrun.run(str(EXAMPLES / "train_mlp.py")))
    assert "rank 0/2 (launched by torchrun" in result.stdout
    assert "rank 1/2 (launched by torchrun" in result.stdout
    assert "final loss" in result.stdout


def test_demo_runs_unchanged_as_one_process() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_mlp.py")], env=worker_env(), capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0/1 (launched by none" in result.stdout
