"""TEST DOUBLE of ``apex/parallel/__init__.py`` from NVIDIA apex 25.05 (see tests/doubles/README.md): its
``ReduceOp`` and ``DistributedDataParallel`` only. apex's ``Reducer``, ``SyncBatchNorm``, ``convert_syncbn_model``
and LARC are not modelled."""

import torch

from .distributed import DistributedDataParallel

ReduceOp = torch.distributed.ReduceOp

__all__ = ["DistributedDataParallel", "ReduceOp"]
