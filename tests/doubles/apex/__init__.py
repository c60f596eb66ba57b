"""TEST DOUBLE of NVIDIA apex 25.05 (see tests/doubles/README.md). Not apex: its ``amp`` and ``parallel`` behave as
apex's do, but on the CPU, in plain Python, without apex's compiled extensions.

Like apex's own ``apex/__init__.py`` it imports ``parallel``, ``amp`` and ``fp16_utils`` and defines the
``deprecated_warning`` that ``amp.initialize`` and ``apex.parallel.DistributedDataParallel`` emit.
"""

import warnings

import torch

from . import amp, fp16_utils, parallel

__all__ = ["amp", "fp16_utils", "parallel"]

#: Real apex has no such flag: tests (and lightning_ddp_amp's env report) read it to tell the double from apex.
IS_TEST_DOUBLE = True


class DeprecatedFeatureWarning(FutureWarning):
    """apex/__init__.py: ``DeprecatedFeatureWarning``."""


def deprecated_warning(msg: str) -> None:
    """apex/__init__.py ``deprecated_warning``: a FutureWarning, from rank 0 only once a process group exists."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=1)
