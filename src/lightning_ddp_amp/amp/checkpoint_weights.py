"""The weights a checkpoint written under apex O2 holds: the fp32 masters the optimizer steps, not their fp16 copies,
so that ``32-true``, ``16-mixed``, ``bf16-mixed``, ``amp-O*`` or ``load_from_checkpoint`` read the weights apex trained
(an apex O2 resume still restores its masters exactly, from the plugin's own state)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch.nn import Module


def put_fp32_masters(state: dict[str, Tensor], module: Module, pairs: Iterable[tuple[Tensor, Tensor]]) -> None:
    """Replace, in ``module``'s ``state``, each fp16 weight the optimizer steps through a master by that fp32 master.

    Every name of a tied weight is replaced; the masters are not copied (a checkpoint saves them once).

    Args:
        state: ``module``'s state dict, changed in place.
        module: The module whose weights ``state`` holds.
        pairs: Each model weight and its fp32 master (``AmpBackend.master_weight_pairs()``); none outside apex O2.
    """
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for stepped, master in pairs:
        for name in names.get(id(stepped), []):
            if name in state:
                state[name] = master.detach()
