# Generated from ../../amp/__init__.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""AMP: :class:`~lightning_ddp_amp.pytorch_lightning.AmpPrecision`, the interface it delegates to, and its apex and torch.amp backends.

Nothing here imports the launching or DDP parts.
"""
