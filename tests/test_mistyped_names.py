"""A precision string or a strategy name that is almost the package's is refused by the package, with the one it was
meant to be named, at every door: the Trainer (both flavours), Fabric, a LightningCLI config, and compare. Lightning's
own values reach Lightning unchanged; a strategy name near none of ours stays Lightning's to refuse."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Flavour
from lightning.fabric import Fabric
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ddp_amp import (
    LightningDDPAmpError,
    PrecisionConfigurationError,
    StrategyConfigurationError,
    _lightning,
)
from lightning_ddp_amp.commands.compare import command as compare
from lightning_ddp_amp.errors import nearest
from lightning_ddp_amp.precision_strings import nearest_precision
from lightning_ddp_amp.trainer.cli import LightningCLI

#: (mistyped, meant): case, a zero for the O, an underscore for the dash, a level past apex's O3.
PRECISION_TYPOS = [("amp-o1", "amp-O1"), ("apex-01", "apex-O1"), ("apex_O1", "apex-O1"), ("amp-O4", "amp-O3")]
#: (mistyped, meant).
STRATEGY_TYPOS = [
    ("env_ddp", "envddp"),
    ("env-ddp", "envddp"),
    ("envdpp", "envddp"),
    ("envddp_find_unused_parameters", "envddp_find_unused_parameters_true"),
]
#: The package's precision strings, as the messages list them.
OURS = ("apex-O0 ... apex-O3", "amp-O0 ... amp-O3", "native-O0 ... native-O3")
#: Every value Lightning accepts, its aliases included.
LIGHTNINGS_PRECISIONS = [*_lightning.precision_values(), 64, 32, 16]


def assert_names_the_precision_meant(error: LightningDDPAmpError, typo: str, meant: str) -> None:
    assert (error.field, error.value) == ("precision", typo)
    assert f"Fix: did you mean {meant!r}?" in str(error)
    assert all(family in error.fix for family in OURS)
    assert all(value in error.fix for value in _lightning.precision_values())


def assert_names_the_strategy_meant(error: LightningDDPAmpError, typo: str, meant: str) -> None:
    assert (error.field, error.value) == ("strategy", typo)
    assert f"Fix: did you mean {meant!r}?" in str(error)
    assert "lightning_ddp_amp registers 'envddp' and 'envddp_find_unused_parameters_true'" in error.fix


def trainer(flavour: Flavour, **kwargs: Any) -> Any:
    return flavour.pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **kwargs)


def cli_config(tmp_path: Path, strategy: str, precision: str) -> list[str]:
    config = tmp_path / "config.yaml"
    config.write_text(
        f"trainer:\n  strategy: {strategy}\n  precision: {precision}\n  accelerator: cpu\n  logger: false\n"
    )
    return ["--config", str(config)]


@pytest.mark.parametrize(("typo", "meant"), PRECISION_TYPOS)
def test_a_mistyped_precision_names_the_one_meant_at_the_trainer(typo: str, meant: str, flavour: Flavour) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        trainer(flavour, strategy="envddp", precision=typo)
    assert_names_the_precision_meant(raised.value, typo, meant)


@pytest.mark.parametrize(("typo", "meant"), PRECISION_TYPOS)
def test_a_mistyped_precision_names_the_one_meant_at_fabric(typo: str, meant: str) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        Fabric(strategy="envddp", precision=typo, accelerator="cpu")  # type: ignore[arg-type]
    assert_names_the_precision_meant(raised.value, typo, meant)


def test_a_mistyped_precision_in_a_cli_config_names_the_one_meant(tmp_path: Path) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        LightningCLI(BoringModel, args=cli_config(tmp_path, "envddp", "apex-01"), run=False)
    assert_names_the_precision_meant(raised.value, "apex-01", "apex-O1")


@pytest.mark.parametrize(("typo", "meant"), PRECISION_TYPOS)
def test_compare_names_the_precision_meant_as_the_trainer_does(
    typo: str, meant: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        compare.main(["32-true", typo, "--", "python", "train.py"])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert f"PRECISION={typo!r}: " in error and f"Fix: did you mean {meant!r}?" in error
    assert all(family in error for family in OURS)


@pytest.mark.parametrize(("typo", "meant"), STRATEGY_TYPOS)
def test_a_mistyped_envddp_names_the_one_meant_at_the_trainer(typo: str, meant: str, flavour: Flavour) -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        trainer(flavour, strategy=typo)
    assert_names_the_strategy_meant(raised.value, typo, meant)


@pytest.mark.parametrize(("typo", "meant"), STRATEGY_TYPOS)
def test_a_mistyped_envddp_names_the_one_meant_at_fabric(typo: str, meant: str) -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        Fabric(strategy=typo, accelerator="cpu")
    assert_names_the_strategy_meant(raised.value, typo, meant)


def test_a_mistyped_envddp_in_a_cli_config_names_the_one_meant(tmp_path: Path) -> None:
    with pytest.raises(StrategyConfigurationError) as raised:
        LightningCLI(BoringModel, args=cli_config(tmp_path, "env_ddp", "32-true"), run=False)
    assert_names_the_strategy_meant(raised.value, "env_ddp", "envddp")


def test_envddp_in_another_case_is_envddp_as_lightning_reads_names(flavour: Flavour) -> None:
    assert type(trainer(flavour, strategy="envDDP").strategy) is flavour.plugins.EnvDDPStrategy


@pytest.mark.parametrize("name", ["ddpp", "ddp_spwan", "nonsense"])
def test_a_strategy_name_near_none_of_ours_is_still_the_trainers_to_refuse(name: str, flavour: Flavour) -> None:
    with pytest.raises(ValueError, match=f"You selected an invalid strategy name: `strategy='{name}'`") as raised:
        trainer(flavour, strategy=name)
    assert not isinstance(raised.value, LightningDDPAmpError)


def build_or_lightnings_refusal(build: Callable[[], Any], value: Any) -> None:
    """Build, where Lightning accepts ``value`` here; "transformer-engine" is Lightning's too, refused by Lightning
    where transformer_engine is not installed. Never the package's refusal."""
    try:
        build()
    except LightningDDPAmpError as error:
        raise AssertionError(f"the package refused Lightning's precision {value!r}") from error
    except ImportError:
        assert str(value).startswith("transformer-engine")


@pytest.mark.parametrize("value", LIGHTNINGS_PRECISIONS)
def test_each_of_lightnings_own_precisions_reaches_the_trainer_unchanged(value: Any, flavour: Flavour) -> None:
    build_or_lightnings_refusal(lambda: trainer(flavour, precision=value), value)


@pytest.mark.parametrize("value", LIGHTNINGS_PRECISIONS)
def test_each_of_lightnings_own_precisions_reaches_fabric_unchanged(value: Any) -> None:
    build_or_lightnings_refusal(lambda: Fabric(precision=value, accelerator="cpu"), value)


@pytest.mark.parametrize("name", ["ddpp", "ddp_spwan", "nonsense"])
def test_a_strategy_name_near_none_of_ours_is_still_fabrics_to_refuse(name: str) -> None:
    with pytest.raises(ValueError, match=f"You selected an invalid strategy name: `strategy='{name}'`") as raised:
        Fabric(strategy=name, accelerator="cpu")
    assert not isinstance(raised.value, LightningDDPAmpError)


@pytest.mark.parametrize(
    ("value", "meant"),
    [
        *PRECISION_TYPOS,
        ("AMP-O2", "amp-O2"),
        ("native_o3", "native-O3"),
        ("apexO1", "apex-O1"),
        ("apex-O12", "apex-O3"),
        ("natve-O1", "native-O1"),
        ("16_mixed", "16-mixed"),
        ("BF16-Mixed", "bf16-mixed"),
        ("fp8", None),
    ],
)
def test_the_precision_meant_is_ours_however_mistyped_or_the_nearest_of_all(value: str, meant: str | None) -> None:
    assert nearest_precision(value, _lightning.precision_values()) == meant


def test_the_nearest_name_ignores_case_zero_for_o_and_underscore_for_dash() -> None:
    assert nearest("APEX_01", ["apex-O2", "apex-O1", "apex-O3"]) == "apex-O1"
    assert nearest("zzz", ["apex-O1"]) is None
