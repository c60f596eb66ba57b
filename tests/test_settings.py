"""The AMP options, declared once (:mod:`lightning_ddp_amp.amp.settings`): both doors take them as ``AmpSettings``
declares them, a LightningCLI config reads them typed, and compare carries them to another level as they were given."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

import jsonargparse
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import Unpack

from lightning_ddp_amp import AmpPrecision, PrecisionConfigurationError
from lightning_ddp_amp.amp.settings import AmpOptions, AmpSettings
from lightning_ddp_amp.fabric import AmpPrecision as FabricAmpPrecision

DOORS = {"trainer": AmpPrecision, "fabric": FabricAmpPrecision}
#: Every option at a value other than its default.
GIVEN: AmpOptions = {
    "keep_batchnorm_fp32": True,
    "loss_scale": 128.0,
    "num_losses": 2,
    "min_loss_scale": 1.0,
    "max_loss_scale": 2.0**20,
    "cast_model_outputs": "float32",
    "dtype": "float16",
}


def settings_types() -> dict[str, Any]:
    hints = typing.get_type_hints(AmpSettings)
    return {field.name: hints[field.name] for field in dataclasses.fields(AmpSettings)}


def test_the_options_a_door_takes_by_keyword_are_the_settings_but_the_level() -> None:
    options = settings_types()
    del options["opt_level"]
    assert typing.get_type_hints(AmpOptions) == options
    assert AmpOptions.__required_keys__ == frozenset()  # left out, an option takes AmpSettings' default


@pytest.mark.parametrize("door", DOORS.values(), ids=DOORS.keys())
def test_each_door_takes_the_level_and_the_options_as_the_settings_declare_them(door: type[Any]) -> None:
    parameters = inspect.signature(door).parameters
    types = typing.get_type_hints(door.__init__)
    assert (parameters["opt_level"].default, types["opt_level"]) == (
        AmpSettings.opt_level,
        settings_types()["opt_level"],
    )
    assert parameters["options"].kind is inspect.Parameter.VAR_KEYWORD
    assert types["options"] == Unpack[AmpOptions]


@pytest.mark.parametrize("door", DOORS.values(), ids=DOORS.keys())
def test_each_door_passes_its_options_to_the_settings_untouched(door: type[Any]) -> None:
    assert door("O2", "native", **GIVEN).settings == AmpSettings("O2", **GIVEN)
    assert door().settings == AmpSettings()


def test_settings_run_again_at_another_level_with_every_option_as_given() -> None:
    given = AmpSettings("O2", **GIVEN)
    assert given.options() == GIVEN
    assert AmpSettings("O3", **given.options()) == dataclasses.replace(given, opt_level="O3")


def test_the_settings_read_their_dtypes_as_torchs() -> None:
    settings = AmpSettings(cast_model_outputs="torch.float32", dtype="bfloat16")
    assert (settings.torch_dtype, settings.output_dtype) == (torch.bfloat16, torch.float32)
    assert AmpSettings().output_dtype is None


def test_a_cli_config_gives_every_option_typed() -> None:
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--plugin", type=Precision)
    init_args = {"opt_level": "O2", "backend": "native", **GIVEN}
    config = parser.parse_object({"plugin": {"class_path": "lightning_ddp_amp.AmpPrecision", "init_args": init_args}})
    assert AmpPrecision(**config.plugin.init_args.as_dict()).settings == AmpSettings("O2", **GIVEN)
    with pytest.raises(jsonargparse.ArgumentError, match="max_loss_scale"):
        wrong = {"class_path": "lightning_ddp_amp.AmpPrecision", "init_args": {"max_loss_scale": "huge"}}
        parser.parse_object({"plugin": wrong})


@pytest.mark.parametrize("door", [AmpPrecision, FabricAmpPrecision], ids=["trainer", "fabric"])
def test_a_misspelt_option_is_refused_with_the_option_meant(door: type[Any]) -> None:
    with pytest.raises(PrecisionConfigurationError) as raised:
        door("O1", backend="native", loss_scal=128.0)
    assert str(raised.value).startswith(
        "loss_scal=128.0: not an option of AmpPrecision. Fix: did you mean 'loss_scale'? The options are opt_level,"
        " keep_batchnorm_fp32, loss_scale, num_losses"
    )
