"""TEST DOUBLE of ``apex.parallel`` (see tests/doubles/README.md)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist


class DistributedDataParallel(torch.nn.Module):
    """TEST DOUBLE of ``apex.parallel.DistributedDataParallel``: broadcast on wrap, average gradients in backward.

    Like apex's, it is not a ``torch.nn.parallel.DistributedDataParallel``.
    """

    wrapped: ClassVar[list[str]] = []

    def __init__(
        self, module: torch.nn.Module, message_size: int = 10_000_000, delay_allreduce: bool = False, **_: Any
    ):
        super().__init__()
        self.module = module
        self.delay_allreduce = delay_allreduce
        self._allreduce = True
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._average)
        DistributedDataParallel.wrapped.append(type(module).__name__)

    def _average(self, param: torch.Tensor) -> None:
        if self._allreduce and param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(dist.get_world_size())

    def enable_allreduce(self) -> None:
        self._allreduce = True

    def disable_allreduce(self) -> None:
        self._allreduce = False

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)
