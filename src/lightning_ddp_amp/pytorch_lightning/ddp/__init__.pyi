# Generated from ../../ddp/__init__.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""DDP: :class:`~lightning_ddp_amp.pytorch_lightning.EnvDDPStrategy`, the DDP wrapper's options, sharded data and resuming.

It builds on :mod:`lightning_ddp_amp.launch` and :mod:`lightning_ddp_amp.amp`.
"""
