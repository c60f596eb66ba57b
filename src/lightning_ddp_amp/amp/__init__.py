"""AMP: :class:`~lightning_ddp_amp.AmpPrecision`, the interface it delegates to, and its apex and torch.amp backends.

Nothing here imports the launching or DDP parts.
"""
