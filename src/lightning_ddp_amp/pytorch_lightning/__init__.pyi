# Generated from ../__init__.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""The classic torchrun + DDP + mixed-precision recipe as Lightning plugins.

Importing this package registers ``"envddp"`` (and ``"envddp_find_unused_parameters_true"``) in Lightning's
strategy registry (and in Fabric's) and teaches ``Trainer(precision=...)`` (and ``Fabric(precision=...)``) the values ``"apex-O0"`` … ``"apex-O3"``,
``"amp-O0"`` … ``"amp-O3"`` and ``"native-O0"`` … ``"native-O3"``, so
``Trainer(strategy="envddp", precision="apex-O1")`` works, with ``lightning`` and with the standalone
``pytorch_lightning``, whose plugin classes live in ``lightning_ddp_amp.pytorch_lightning`` (built from the same
files, see ``_namespaces.py``).
"""

from lightning_ddp_amp.launch.environment import Topology, check_rank_variables, read_topology

# Before anything imports Lightning, which parses RANK and LOCAL_RANK with a bare int() at import time.

from pytorch_lightning.strategies import StrategyRegistry  # noqa: E402

from lightning_ddp_amp.pytorch_lightning import _lightning  # noqa: E402
from lightning_ddp_amp.pytorch_lightning.commands.convert import convert_apex_checkpoint  # noqa: E402
from lightning_ddp_amp.errors import (  # noqa: E402
    ApexUnavailableError,
    CheckpointError,
    LauncherEnvironmentError,
    LightningDDPAmpError,
    PeerError,
    PrecisionConfigurationError,
    StrategyConfigurationError,
    TopologyMismatchError,
)
from lightning_ddp_amp.pytorch_lightning.launch.cluster_environment import LauncherEnvironment  # noqa: E402
from lightning_ddp_amp.pytorch_lightning.trainer.precision import AmpPrecision, resolve_precision_flag  # noqa: E402
from lightning_ddp_amp.pytorch_lightning.trainer.strategy import EnvDDPStrategy  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AmpPrecision",
    "ApexUnavailableError",
    "CheckpointError",
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


from lightning_fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES  # noqa: E402

from lightning_ddp_amp.pytorch_lightning import fabric  # noqa: E402
from lightning_ddp_amp.pytorch_lightning.fabric import precision as _fabric_precision  # noqa: E402

# Each front door's hook refuses the other's envddp, so both are installed once both classes exist.
