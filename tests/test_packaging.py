"""The wheel installs anywhere: built by the standard frontend, installed (not editable) into a fresh virtualenv.

The wheel is built once per module from a copy of the sources, and installed into a virtualenv without pip.
That virtualenv gets torch and Lightning offline: a ``.pth`` file lists the directories the running tests import
them from (the dev virtualenv's site-packages, or the cached environment CI's virtualenvs reach through a ``.pth``
of their own), but not this checkout's ``src/``. A directory listed in a ``.pth`` file is only appended to
``sys.path`` and its own ``.pth`` files are not read, so the editable install of this checkout that lives there
(``__editable__.*.pth`` or its import hook) stays invisible. Every command runs from the repository root, as a
user of a checkout would, and must still import the wheel.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import worker_env
from test_namespaces import USER_FILE

REPO = Path(__file__).parents[1]
# Builds and installs the wheel, and starts a pytest run of its own against it.
pytestmark = pytest.mark.multiprocess

#: In-process tests that exercise the installed package without starting ranks, run against the wheel.
CORE_TESTS = ("tests/test_environment.py", "tests/test_devices.py", "tests/test_data.py")


@dataclass(frozen=True)
class Build:
    wheel: Path
    log: str


@dataclass(frozen=True)
class Venv:
    root: Path
    site_packages: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def run(self, *command: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``command`` from the repository root with this venv's ``bin`` first on PATH; no PYTHONPATH."""
        env = worker_env()
        env.pop("PYTHONPATH", None)
        env["PATH"] = f"{self.root / 'bin'}:{env.get('PATH', '')}"
        return subprocess.run(
            [str(part) for part in command],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """``python -m build --wheel`` on a copy of the sources, so that the checkout gets no build/ or egg-info."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy2(REPO / name, source / name)
    # Without the pytorch_lightning flavour, as git has the sources: the build writes it.
    ignored = shutil.ignore_patterns("*.egg-info", "__pycache__", "pytorch_lightning")
    shutil.copytree(REPO / "src", source / "src", ignore=ignored)
    shutil.copytree(REPO / "build_backend", source / "build_backend", ignore=ignored)
    dist = tmp_path_factory.mktemp("dist")
    # No isolation, so no index: the build backend (setuptools) comes from this environment's [dev] extra.
    command = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(source)]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-6000:]
    (wheel,) = dist.glob("lightning_ddp_amp-*.whl")
    return Build(wheel, result.stdout)


@pytest.fixture(scope="module")
def venv(build: Build, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(root)], check=True, timeout=60)
    install = [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install", "--no-deps"]
    result = subprocess.run(
        [*install, "--no-index", "--no-cache-dir", str(build.wheel)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-6000:]
    purelib = subprocess.run(
        [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    site_packages = Path(purelib)
    # After the install, so that pip never sees (or offers to replace) the distribution installed there.
    (site_packages / "_dependencies.pth").write_text("".join(f"{path}\n" for path in dependency_paths()))
    return Venv(root, site_packages)


def dependency_paths() -> list[str]:
    """The directories on this interpreter's ``sys.path`` except the checkout's own (the stdlib's are harmless)."""

    def ours(path: Path) -> bool:
        return path == REPO or path.is_relative_to(REPO / "src") or path.is_relative_to(REPO / "tests")

    return [path for path in sys.path if path and Path(path).is_dir() and not ours(Path(path).resolve())]


def test_the_wheel_ships_the_type_marker_and_the_console_script(build: Build) -> None:
    with zipfile.ZipFile(build.wheel) as wheel:
        names = wheel.namelist()
        (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = wheel.read(entry_points).decode()
    assert "lightning_ddp_amp/py.typed" in names
    # The pytorch_lightning flavour, written by the build: real modules, which type checkers read too.
    assert "lightning_ddp_amp/pytorch_lightning/__init__.py" in names
    assert "lightning_ddp_amp/pytorch_lightning/trainer/strategy.py" in names
    assert not [name for name in names if name.endswith(".pyi")]
    assert "lightning_ddp_amp/commands/compare/_site/sitecustomize.py" in names  # what `compare` puts on PYTHONPATH
    assert "lightning-ddp-amp = lightning_ddp_amp.commands.main:main" in scripts


def test_the_build_uses_no_deprecated_setuptools_configuration(build: Build) -> None:
    # setuptools stops building a `license = { text = ... }` table on 2027-02-18; an SPDX string builds everywhere.
    assert "deprecated" not in build.log.lower(), build.log[-6000:]


def test_the_package_is_imported_from_the_installed_wheel(venv: Venv) -> None:
    probe = (
        "import importlib.metadata, json, sys\n"
        "import pytorch_lightning\n"
        "import lightning_ddp_amp, lightning_ddp_amp.pytorch_lightning as flavour\n"
        "t = pytorch_lightning.Trainer(strategy='envddp', precision='amp-O1', accelerator='cpu', logger=False)\n"
        "import lightning_fabric\n"
        "f = lightning_fabric.Fabric(strategy='envddp', precision='native-O1', accelerator='cpu')\n"
        "print(json.dumps({\n"
        "    'file': lightning_ddp_amp.__file__,\n"
        "    'flavour': flavour.__file__,\n"
        "    'flavour_is_a_pytorch_lightning_strategy': issubclass(\n"
        "        flavour.EnvDDPStrategy, pytorch_lightning.strategies.DDPStrategy),\n"
        "    'trainer': [type(t.strategy).__module__, type(t.precision_plugin).__module__],\n"
        "    'fabric': [type(f.strategy).__module__, type(f.strategy.precision).__module__],\n"
        "    'distribution': str(importlib.metadata.distribution('lightning-ddp-amp').locate_file('')),\n"
        "    'path': sys.path,\n"
        "}))\n"
    )
    result = venv.run(venv.python, "-c", probe)
    assert result.returncode == 0, result.stdout[-6000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    package = venv.site_packages / "lightning_ddp_amp"
    assert Path(found["file"]) == package / "__init__.py"
    assert Path(found["flavour"]).is_relative_to(package)
    assert found["flavour_is_a_pytorch_lightning_strategy"]
    flavour = "lightning_ddp_amp.pytorch_lightning"
    assert found["trainer"] == [f"{flavour}.trainer.strategy", f"{flavour}.trainer.precision"]
    assert found["fabric"] == [f"{flavour}.fabric.strategy", f"{flavour}.fabric.precision"]
    assert Path(found["distribution"]) == venv.site_packages
    assert str(REPO / "src") not in found["path"]


def test_the_type_marker_is_installed(venv: Venv) -> None:
    assert (venv.site_packages / "lightning_ddp_amp" / "py.typed").is_file()


def test_a_user_file_type_checks_against_the_installed_standalone_flavour(venv: Venv, tmp_path: Path) -> None:
    # The installed wheel, not this checkout: mypy runs in the venv, from a folder without src/.
    (tmp_path / "user.py").write_text(USER_FILE)
    command = ["-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), str(tmp_path / "user.py")]
    result = venv.run(venv.python, *command, timeout=600)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, result.stdout
    assert 'user.py:7: error: Argument "timeout" to "EnvDDPStrategy" has incompatible type "str"' in errors[0]


def test_the_console_script_reports_the_environment(venv: Venv) -> None:
    result = venv.run(venv.root / "bin" / "lightning-ddp-amp", "env")
    assert result.returncode == 0, result.stdout[-6000:]
    assert "lightning-ddp-amp 0.1.0 environment report" in result.stdout


def test_core_tests_pass_against_the_wheel(venv: Venv) -> None:
    pytest_args = ["-p", "no:cacheprovider", "-q", "-m", "not multiprocess and not faults", *CORE_TESTS]
    result = venv.run(venv.python, "-m", "pytest", *pytest_args, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:]
