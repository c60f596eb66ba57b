"""The one place where lightning_ddp_amp touches Lightning's private API: this package, and nothing else.

Each function and name here says why it is needed: :mod:`.connectors` hooks into the construction of a Trainer and
of a Fabric, :mod:`.loops` reads and moves the fit loop's undocumented counters and checkpoint entries, and
:mod:`.members` holds the private classes and helpers used as they are. The package's subclasses of Lightning's
classes also use the protected members they inherit, as any subclass does (``EnvDDPStrategy`` overrides
``_configure_launcher``, ``_setup_model`` and ``_register_ddp_hooks``, and reads ``_ddp_kwargs``, ``_launcher``, ...);
:data:`INHERITED` lists every one. ``tests/test_lightning_internals.py`` exercises each function here, checks that
each inherited member still exists and that each override keeps Lightning's parameters, and CI runs it against the
lowest and the highest Lightning release declared in ``pyproject.toml``. ``tests/test_imports.py`` checks that no
module outside this package imports a private Lightning name.

The rest of the package imports this package only (``from lightning_ddp_amp import _lightning``), and calls what it
exports.
"""

from lightning_ddp_amp._lightning.connectors import TESTED_LIGHTNING, install_fabric_hook, install_trainer_hook
from lightning_ddp_amp._lightning.loops import (
    disable_sigterm_broadcast,
    epoch_boundary_loops,
    epoch_progress,
    evaluation_metrics,
    is_loader_state_mismatch,
    make_stateful,
    move_epoch_batches,
    saved_loader_states,
    saved_mid_epoch,
)
from lightning_ddp_amp._lightning.members import (
    INHERITED,
    DummyLogger,
    StrategyRegistryType,
    UnrepeatedDistributedSampler,
    UnrepeatedDistributedSamplerWrapper,
    after_closure,
    is_fabric_optimizer,
    keep_fabric_zero_grad,
    launched_with_ckpt_path,
    optimizers_to_device,
    precision_values,
    rebuild_dataloader,
    sampler_injection,
    set_sampler_injection,
    silenced_callback_hooks,
    trainer_env_defaults,
    version,
)

__all__ = [
    "INHERITED",
    "TESTED_LIGHTNING",
    "DummyLogger",
    "StrategyRegistryType",
    "UnrepeatedDistributedSampler",
    "UnrepeatedDistributedSamplerWrapper",
    "after_closure",
    "disable_sigterm_broadcast",
    "epoch_boundary_loops",
    "epoch_progress",
    "evaluation_metrics",
    "install_fabric_hook",
    "install_trainer_hook",
    "is_fabric_optimizer",
    "is_loader_state_mismatch",
    "keep_fabric_zero_grad",
    "launched_with_ckpt_path",
    "make_stateful",
    "move_epoch_batches",
    "optimizers_to_device",
    "precision_values",
    "rebuild_dataloader",
    "sampler_injection",
    "saved_loader_states",
    "saved_mid_epoch",
    "set_sampler_injection",
    "silenced_callback_hooks",
    "trainer_env_defaults",
    "version",
]
