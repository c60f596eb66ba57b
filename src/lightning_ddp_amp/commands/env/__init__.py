"""``lightning-ddp-amp env``: what this process would train with, and what stands in the way.

The report covers the launcher and topology this rank reads (:mod:`~lightning_ddp_amp.commands.env.launcher`), its
devices, the versions of torch, Lightning, CUDA, cuDNN and NCCL and the process-group backends
(:mod:`~lightning_ddp_amp.commands.env.machine`), and NVIDIA apex: whether it is installed at all, whether it is the
impostor from PyPI, whether ``apex.amp`` is still there, and whether its compiled extensions load with this torch
(:mod:`~lightning_ddp_amp.commands.env.apex`). Each problem comes with its fix in one line.
:mod:`~lightning_ddp_amp.commands.env.command` gathers the sections and prints them, as JSON or as text
(:mod:`~lightning_ddp_amp.commands.env.text`).

It starts no process group and writes nothing, so it is safe on any rank of a running job and on a machine without
a GPU. apex's compiled extensions are loaded in a child process: one built for another torch can crash the
interpreter that imports it (the segmentation fault users meet in ``scaled_loss.backward()``).
"""
