"""The classic torchrun + DDP + mixed-precision recipe as Lightning plugins.

Importing this package registers ``"envddp"`` (and ``"envddp_find_unused_parameters_true"``) in Lightning's
strategy registry (and in Fabric's) and teaches ``Trainer(precision=...)`` (and ``Fabric(precision=...)``) the values ``"apex-O0"`` … ``"apex-O3"``,
``"amp-O0"`` … ``"amp-O3"`` and ``"native-O0"`` … ``"native-O3"``, so
``Trainer(strategy="envddp", precision="apex-O1")`` works, with ``lightning`` and with the standalone
``pytorch_lightning``, whose plugin classes live in ``lightning_ddp_amp.pytorch_lightning`` (these modules with
Lightning's imports renamed, written when the package is built: ``build_backend/``; ``_standalone.py``).
"""

from lightning_ddp_amp.launch.environment import check_rank_variables, read_topology
from lightning_ddp_amp.launch.topology import Topology

# Before anything imports Lightning, which parses RANK and LOCAL_RANK with a bare int() at import time.
check_rank_variables()

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_ddp_amp import _lightning  # noqa: E402
from lightning_ddp_amp.commands.convert import convert_apex_checkpoint  # noqa: E402
from lightning_ddp_amp.errors import (  # noqa: E402
    ApexUnavailableError,
    CheckpointError,
    CompareScriptError,
    LauncherEnvironmentError,
    LightningDDPAmpError,
    PeerError,
    PrecisionConfigurationError,
    StrategyConfigurationError,
    TopologyMismatchError,
)
from lightning_ddp_amp.launch.cluster_environment import LauncherEnvironment  # noqa: E402
from lightning_ddp_amp.trainer.precision import AmpPrecision, resolve_precision_flag  # noqa: E402
from lightning_ddp_amp.trainer.strategy import EnvDDPStrategy  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AmpPrecision",
    "ApexUnavailableError",
    "CheckpointError",
    "CompareScriptError",
    "EnvDDPStrategy",
    "LauncherEnvironment",
    "LauncherEnvironmentError",
    "LightningDDPAmpError",
    "PeerError",
    "PrecisionConfigurationError",
    "StrategyConfigurationError",
    "Topology",
    "TopologyMismatchError",
    "convert_apex_checkpoint",
    "read_topology",
]

if EnvDDPStrategy.strategy_name not in StrategyRegistry:
    EnvDDPStrategy.register_strategies(StrategyRegistry)

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES  # noqa: E402

from lightning_ddp_amp import fabric  # noqa: E402
from lightning_ddp_amp.fabric import precision as _fabric_precision  # noqa: E402

if fabric.EnvDDPStrategy.strategy_name not in FABRIC_STRATEGIES:
    fabric.EnvDDPStrategy.register_strategies(FABRIC_STRATEGIES)
# Each front door's hook refuses the other's envddp, so both are installed once both classes exist.
_lightning.install_trainer_hook(resolve_precision_flag, EnvDDPStrategy, AmpPrecision, fabric.EnvDDPStrategy)
_lightning.install_fabric_hook(
    _fabric_precision.resolve_precision_flag, fabric.EnvDDPStrategy, fabric.AmpPrecision, EnvDDPStrategy
)

if __name__ == "lightning_ddp_amp":  # not in lightning_ddp_amp.pytorch_lightning, which is built from this file
    from lightning_ddp_amp import _standalone

    _standalone.install()
