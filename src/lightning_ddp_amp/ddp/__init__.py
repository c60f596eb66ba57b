"""DDP: :class:`~lightning_ddp_amp.EnvDDPStrategy`, the DDP wrapper's options, sharded data and resuming.

It builds on :mod:`lightning_ddp_amp.launch` and :mod:`lightning_ddp_amp.amp`.
"""
