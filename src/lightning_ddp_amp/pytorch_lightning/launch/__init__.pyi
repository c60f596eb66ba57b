# Generated from ../../launch/__init__.py by lightning_ddp_amp._namespaces.write_stubs(); never edit.
"""Launching: the launcher's variables, the cluster environment, devices, the process group, self-launch, SIGTERM.

Nothing here imports the DDP or AMP parts; :mod:`lightning_ddp_amp.ddp` builds on it.
"""
