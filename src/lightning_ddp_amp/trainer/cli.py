"""LightningCLI that accepts this package's precision strings in a typed config.

``Trainer(precision="apex-O1")`` works in Python as soon as ``lightning_ddp_amp`` is imported, but Lightning's
LightningCLI checks ``trainer.precision`` against the Trainer's type hint, which lists only Lightning's own
values. This module's :class:`LightningCLI` is a drop-in for Lightning's whose Trainer also accepts
``"apex-O0"`` … ``"apex-O3"``, ``"amp-O0"`` … ``"amp-O3"`` and ``"native-O0"`` … ``"native-O3"``::

    # config.yaml
    trainer:
      strategy: envddp
      precision: apex-O1

With Lightning's own LightningCLI, put the plugin in ``trainer.plugins`` instead::

    trainer:
      strategy: envddp
      plugins:
        - class_path: lightning_ddp_amp.AmpPrecision
          init_args: {opt_level: O1, backend: auto}
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Literal, Union

from lightning.pytorch import Trainer as LightningTrainer
from lightning.pytorch.cli import LightningCLI as LightningLightningCLI

import lightning_ddp_amp  # noqa: F401  (registers "envddp" and the precision strings)

AmpPrecisionFlag = Literal[
    "apex-O0", "apex-O1", "apex-O2", "apex-O3",
    "amp-O0", "amp-O1", "amp-O2", "amp-O3",
    "native-O0", "native-O1", "native-O2", "native-O3",
]  # fmt: skip

if TYPE_CHECKING:
    LightningPrecision = Any
else:
    # Lightning's own annotation of Trainer(precision=...), read from its public signature.
    LightningPrecision = inspect.signature(LightningTrainer.__init__).parameters["precision"].annotation


class Trainer(LightningTrainer):
    """Lightning's Trainer, with ``precision`` typed to also accept ``"apex-O*"``, ``"amp-O*"`` and ``"native-O*"``.

    Args:
        precision: Any value Lightning accepts, or one of this package's precision strings.
        **kwargs: Every other ``lightning.pytorch.Trainer`` argument.
    """

    def __init__(self, *, precision: Union[LightningPrecision, AmpPrecisionFlag] = None, **kwargs: Any) -> None:  # noqa: UP007
        super().__init__(precision=precision, **kwargs)  # type: ignore[arg-type]  # the hook resolves the strings


class LightningCLI(LightningLightningCLI):
    """Lightning's LightningCLI, building :class:`Trainer` unless given another ``trainer_class``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("trainer_class", Trainer)
        super().__init__(*args, **kwargs)
