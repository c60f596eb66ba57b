"""``lightning-ddp-amp compare``: one training command under several precisions, and how far apart they land.

The command and its runs: :mod:`~lightning_ddp_amp.commands.compare.command`; inside each run:
:mod:`~lightning_ddp_amp.commands.compare.patching` and :mod:`~lightning_ddp_amp.commands.compare.recording`; the
report: :mod:`~lightning_ddp_amp.commands.compare.report`.
"""
