"""TEST DOUBLE of ``apex/parallel/distributed.py``: apex's ``DistributedDataParallel`` on one CUDA stream.

What it shares with apex: at construction it broadcasts rank 0's parameters (not the buffers); in the first
backward after a forward with a new parameter list it records the order in which gradients arrive, buckets them
by type and ``message_size``, and allreduces everything at the end of the backward; later backwards allreduce each
bucket as soon as it is full, in order, and fail at the end of the backward if a bucket was not allreduced, or
during it if a gradient arrives twice. Gradients are averaged (``gradient_average``). ``disable_allreduce()``
pauses all of it. With ``delay_allreduce`` everything is allreduced at the end of each backward.

apex's extra streams and communicators, ``retain_allreduce_buffers``, ``allreduce_trigger_params`` and ``prof``
raise NotImplementedError here. As in apex, the forward must run through the wrapper: a backward whose graph did
not start in this wrapper's forward fails in apex's hooks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.autograd import Variable
from torch.nn import Module

#: apex's ``param_type_to_tmp_i`` and ``split_half_float_double``: buckets hold one type each, in this order.
_BUCKET_TYPES = (torch.float16, torch.float32, torch.float64)


def _bucket_type(tensor: torch.Tensor) -> int | None:
    """distributed.py ``param_type_to_tmp_i``: index of the tensor's type in :data:`_BUCKET_TYPES`; None off the
    amp device (apex: not CUDA)."""
    from apex.amp._amp_state import on_amp_device

    if on_amp_device(tensor) and tensor.dtype in _BUCKET_TYPES:
        return _BUCKET_TYPES.index(tensor.dtype)
    return None


def flat_dist_call(tensors: list[torch.Tensor], call: Any, extra_args: tuple[Any, ...] = ()) -> None:
    """distributed.py ``flat_dist_call``: one flattened call per tensor type, averaged after an allreduce."""
    buckets: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    for bucket in buckets.values():
        coalesced = _flatten_dense_tensors(bucket)
        call(coalesced, *extra_args)
        if call is dist.all_reduce:
            coalesced /= dist.get_world_size()
        for buf, synced in zip(bucket, _unflatten_dense_tensors(coalesced, bucket)):  # noqa: B905
            buf.copy_(synced)


def split_half_float_double(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """distributed.py ``split_half_float_double``: tensors of other types (apex: not on CUDA) are left out."""
    buckets: list[list[torch.Tensor]] = [[] for _ in _BUCKET_TYPES]
    for tensor in tensors:
        index = _bucket_type(tensor)
        if index is not None:
            buckets[index].append(tensor)
    return [bucket for bucket in buckets if bucket]


class DistributedDataParallel(Module):
    """distributed.py ``DistributedDataParallel``; like apex's, it is not a ``torch.nn.parallel`` DDP.

    Args:
        module: The model; its parameters are broadcast from rank 0 here.
        message_size: Elements per bucket before a bucket is closed.
        delay_allreduce: Allreduce everything at the end of each backward.
        gradient_average: Divide the allreduced gradients by the world size.
        gradient_predivide_factor: Divide by this before the allreduce, and by ``world_size / factor`` after.
        allreduce_always_fp32: Allreduce fp16 gradients in fp32.
    """

    def __init__(
        self,
        module: Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Any = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Any = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: Any = None,
        prof: bool = False,
    ) -> None:
        super().__init__()
        from apex import deprecated_warning

        deprecated_warning(
            "apex.parallel.DistributedDataParallel is deprecated and will be removed by the end of February 2023."
        )
        self._backend = dist.get_backend()
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError("self.allreduce_different_streams may only be used if delay_allreduce=False.")
        if shared_param is not None:
            raise ValueError(
                "shared_param is no longer supported as an option.  It was misleadingly named from the start.  It"
                " turns out overlapping communication with computation should work fine with shared parameters.  If"
                " you still wish to delay communication to the end of the backward pass, use"
                " delay_allreduce=True|False instead."
            )
        self.world_size = float(dist.get_world_size())
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError("Setting allreduce_trigger_params is only valid if delay_allreduce=False.")
        unsupported = {
            "allreduce_trigger_params": allreduce_trigger_params is not None,
            "retain_allreduce_buffers": retain_allreduce_buffers,
            "num_allreduce_streams": num_allreduce_streams > 1,
            "allreduce_communicators": allreduce_communicators is not None,
            "prof": prof,
        }
        if any(unsupported.values()):
            names = ", ".join(name for name, used in unsupported.items() if used)
            raise NotImplementedError(f"the apex test double does not model DistributedDataParallel({names}=...)")
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        self.delay_allreduce = delay_allreduce
        self.message_size = message_size
        self.module = module
        self._disable_allreduce = False
        if self._backend == dist.Backend.NCCL:
            for param in self.module.parameters():
                assert param.is_cuda, "NCCL backend only supports model parameters to be on GPU."
        self.active_params: list[torch.Tensor] = []
        for param in self.module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._allreduce_hook)
        flat_dist_call([param.data for param in self.module.parameters()], dist.broadcast, (0,))

    def __getstate__(self) -> dict[str, Any] | None:
        """distributed.py ``DistributedDataParallel.__getstate__``, bug included: apex deletes the keys
        ``'self.bucket_streams'`` and ``'self.bucket_events'``, which never exist, so copying or pickling the wrapper
        raises ``KeyError`` off NCCL and yields no state on NCCL."""
        attrs = dict(self.__dict__)
        if self._backend != dist.Backend.NCCL:
            del attrs["self.bucket_streams"]
            del attrs["self.bucket_events"]
            return attrs
        return None

    def enable_allreduce(self) -> None:
        """distributed.py ``DistributedDataParallel.enable_allreduce``."""
        self._disable_allreduce = False

    def disable_allreduce(self) -> None:
        """distributed.py ``DistributedDataParallel.disable_allreduce``."""
        self._disable_allreduce = True

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """distributed.py ``forward``: run the module, then get ready for the next backward's allreduce."""
        result = self.module(*inputs, **kwargs)
        if not self._disable_allreduce:
            if not self.delay_allreduce:
                param_list = [param for param in self.module.parameters() if param.requires_grad]
                if (
                    not self.active_params
                    or len(param_list) != len(self.active_params)
                    or any(mine is not theirs for mine, theirs in zip(param_list, self.active_params))  # noqa: B905
                ):
                    self.needs_refresh = True
                if self.needs_refresh:
                    self.active_i_buckets: list[list[int]] = []
                    self.tmp_buckets: list[list[int]] = [[] for _ in _BUCKET_TYPES]
                    self.tmp_numels = [0 for _ in _BUCKET_TYPES]
                    self.param_id_to_active_i = {id(param): i for i, param in enumerate(param_list)}
                    self.param_id_to_bucket: dict[int, tuple[int, int]] = {}
                else:
                    self.buckets = [[None] * size for size in self.bucket_sizes]
                    self.buckets_ready_size = [0 for _ in range(self.num_buckets)]
                    self.next_bucket = 0
                    self.ready_buckets_not_reduced: set[int] = set()
                self.active_params = param_list
            self.callback_queued = False
        return result

    def _allreduce_hook(self, param: torch.Tensor) -> None:
        """apex's ``allreduce_hook`` on each parameter's gradient accumulator. Attributes that only ``forward``
        sets (``needs_refresh``, ``callback_queued``) fail here, as in apex, when the forward skipped the wrapper."""
        if self._disable_allreduce:
            return
        if self.delay_allreduce or self.needs_refresh:
            if not self.delay_allreduce:
                self._record_arrival(param)
            if not self.callback_queued:
                Variable._execution_engine.queue_callback(self._allreduce_params)
                self.callback_queued = True
        else:
            if not self.callback_queued:
                Variable._execution_engine.queue_callback(self._overlapping_backward_epilogue)
                self.callback_queued = True
            self._comm_ready_buckets(param)

    def _record_arrival(self, param: torch.Tensor) -> None:
        """distributed.py ``allreduce_hook`` (in ``create_hooks``) while ``needs_refresh``: build the buckets in the
        order gradients arrive: one open bucket per type, closed at message_size."""
        active_i = self.param_id_to_active_i[id(param)]
        current_type = _bucket_type(param)
        if current_type is None:
            raise KeyError(param.type())
        self.tmp_buckets[current_type].append(active_i)
        self.tmp_numels[current_type] += param.numel()
        if self.tmp_numels[current_type] >= self.message_size:
            self.active_i_buckets.append(self.tmp_buckets[current_type])
            self.tmp_buckets[current_type] = []
            self.tmp_numels[current_type] = 0

    def _allreduce_params(self) -> None:
        """distributed.py ``allreduce_params`` (in ``create_hooks``) and ``allreduce_fallback``: take rank 0's
        buckets after a refresh, then allreduce every gradient, one flat call per type."""
        if not self.delay_allreduce and self.needs_refresh:
            self._sync_bucket_structure()
            self.needs_refresh = False
        grads = [param.grad.data for param in self.module.parameters() if param.grad is not None]
        for bucket in split_half_float_double(grads):
            self._allreduce_bucket(bucket)

    def _sync_bucket_structure(self) -> None:
        """distributed.py ``sync_bucket_structure``: every rank takes rank 0's buckets."""
        self.active_i_buckets += [bucket for bucket in self.tmp_buckets if bucket]
        sizes = [len(bucket) for bucket in self.active_i_buckets]
        flat = [i for bucket in self.active_i_buckets for i in bucket]
        info = torch.tensor([len(sizes), *sizes, *flat], dtype=torch.int32, device=self.active_params[0].device)
        dist.broadcast(info, 0)
        info_list = [int(entry) for entry in info]
        self.num_buckets = info_list[0]
        self.bucket_sizes = info_list[1 : self.num_buckets + 1]
        flat = info_list[self.num_buckets + 1 :]
        self.buckets = [[None] * size for size in self.bucket_sizes]
        self.active_i_buckets = []
        for bucket_idx, size in enumerate(self.bucket_sizes):
            self.active_i_buckets.append(flat[:size])
            for bucket_loc, param_i in enumerate(flat[:size]):
                self.param_id_to_bucket[id(self.active_params[param_i])] = (bucket_idx, bucket_loc)
            flat = flat[size:]

    def _comm_ready_buckets(self, param: torch.Tensor) -> None:
        """distributed.py ``comm_ready_buckets``: fill the gradient's slot; allreduce full buckets in order."""
        bucket_idx, bucket_loc = self.param_id_to_bucket[id(param)]
        if self.buckets[bucket_idx][bucket_loc] is not None:
            raise RuntimeError(
                "The backward pass is attempting to replace an already-filled bucket slot.  This is almost certainly"
                " an error."
            )
        self.buckets[bucket_idx][bucket_loc] = param.grad.data
        self.buckets_ready_size[bucket_idx] += 1
        if self.buckets_ready_size[bucket_idx] != self.bucket_sizes[bucket_idx]:
            return
        if bucket_idx != self.next_bucket:
            self.ready_buckets_not_reduced.add(bucket_idx)
            return
        self._allreduce_bucket(self.buckets[bucket_idx])
        self.next_bucket += 1
        for i in sorted(self.ready_buckets_not_reduced):
            if i > self.next_bucket:
                break
            self._allreduce_bucket(self.buckets[i])
            self.ready_buckets_not_reduced.remove(i)
            self.next_bucket += 1

    def _overlapping_backward_epilogue(self) -> None:
        """distributed.py ``overlapping_backward_epilogue`` (in ``create_hooks``): every bucket was allreduced."""
        if self.next_bucket != self.num_buckets:
            raise RuntimeError(
                f"In epilogue, next_bucket ({self.next_bucket}) != num_buckets ({self.num_buckets}).  ",
                "This probably indicates some buckets were not allreduced.",
            )
        if self.buckets_ready_size != self.bucket_sizes:
            raise RuntimeError("Some param buckets were not allreduced.")

    def _allreduce_bucket(self, bucket: list[torch.Tensor]) -> None:
        """distributed.py ``allreduce_bucket``: flatten, (pre)divide, allreduce, average, copy back."""
        tensor = _flatten_dense_tensors(bucket)
        to_reduce = tensor.float() if self.allreduce_always_fp32 else tensor
        if self.gradient_predivide_factor != 1.0:
            to_reduce.mul_(1.0 / self.gradient_predivide_factor)
        dist.all_reduce(to_reduce)
        if self.gradient_average:
            to_reduce.mul_(self.gradient_predivide_factor / self.world_size)
        if to_reduce is not tensor:
            tensor.copy_(to_reduce)
        for buf, synced in zip(bucket, _unflatten_dense_tensors(tensor, bucket)):  # noqa: B905
            buf.copy_(synced)
