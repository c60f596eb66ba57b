# Generated from ../../fabric/__init__.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""envddp and AmpPrecision for Lightning Fabric: ``Fabric(strategy="envddp", precision="apex-O1")``.

``import lightning_ddp_amp`` registers ``"envddp"`` in Fabric's strategy registry and teaches ``Fabric(precision=...)``
the strings ``"apex-O0"`` … ``"native-O3"``, as for the Trainer. See docs/fabric.md.
"""

from lightning_ddp_amp.pytorch_lightning.fabric.precision import AmpPrecision
from lightning_ddp_amp.pytorch_lightning.fabric.strategy import EnvDDPStrategy, setup_models

__all__ = ["AmpPrecision", "EnvDDPStrategy", "setup_models"]
