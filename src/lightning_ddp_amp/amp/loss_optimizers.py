"""Which optimizers a loss is scaled for: what the classic script's ``amp.scale_loss(loss, optimizers)`` named.

apex acts on the optimizers ``amp.scale_loss`` is handed, and only on them: after an overflow it skips the next step
of each, and it unscales (under O2: copies into the fp32 masters) only their gradients. So the list changes what
trains, and a superset is not safe: a discriminator's overflow would skip the generator's next step too.
``fabric.backward(loss)`` and ``self.manual_backward(loss)`` need not name it; the rule, the same for both front doors
and both backends (torch's GradScaler checks each optimizer's own gradients, so there the rule only keeps a script
portable between apex and native):

* ``optimizers=`` given: those, as the classic line named them.
* one optimizer set up: that one.
* several: the one whose parameters the loss's autograd graph reaches. A loss that reaches the parameters of several
  (a generator's loss through the discriminator) or of none is refused, naming ``optimizers=``: which of them the
  classic script scaled cannot be known.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_ddp_amp.errors import PrecisionConfigurationError


class LossOptimizers:
    """The optimizers set up, and which of them own each parameter, recorded before apex replaces O2's parameters in
    the optimizers by their fp32 masters.

    Args:
        call: How the script runs backward, for messages: ``"fabric.backward"`` or ``"self.manual_backward"``.
    """

    def __init__(self, call: str) -> None:
        self.call = call
        self.optimizers: list[Optimizer] = []
        self._owners: dict[int, set[int]] = {}

    def add(self, optimizers: Iterable[Optimizer]) -> None:
        """Record ``optimizers`` (raw, not wrapped), set up after those recorded so far."""
        for optimizer in optimizers:
            index = len(self.optimizers)
            self.optimizers.append(optimizer)
            for group in optimizer.param_groups:
                for param in group["params"]:
                    self._owners.setdefault(id(param), set()).add(index)

    def choose(self, loss: Tensor, given: Any, loss_id: int) -> list[Optimizer]:
        """The optimizers ``loss`` is scaled for (see the module).

        Args:
            loss: The loss backward runs on.
            given: ``optimizers=`` as the script passed it (an optimizer, a sequence, wrapped or not), or None.
            loss_id: The loss scaler, for messages.

        Raises:
            PrecisionConfigurationError: ``given`` is None, several optimizers are set up, and the loss reaches the
                parameters of several of them or of none.
        """
        if given is not None:
            chosen = list(given) if isinstance(given, (list, tuple)) else [given]
            return [getattr(optimizer, "optimizer", optimizer) for optimizer in chosen]
        if len(self.optimizers) <= 1:
            return list(self.optimizers)
        reached = self._reached(loss)
        if len(reached) == 1:
            return [self.optimizers[reached.pop()]]
        names = [f"{index} ({type(self.optimizers[index]).__name__})" for index in sorted(reached)]
        reaches = f"the parameters of optimizers {' and '.join(names)}" if names else "no parameter of any of them"
        raise PrecisionConfigurationError(
            "optimizers",
            None,
            f"{self.call}(loss, loss_id={loss_id}) with {len(self.optimizers)} optimizers set up: the loss reaches"
            f" {reaches}, and which of them the classic script's amp.scale_loss scaled cannot be known (apex skips"
            " the next step of each optimizer it is handed after an overflow, and unscales only their gradients)",
            f"name them as the classic line `with amp.scale_loss(loss, optimizer, loss_id={loss_id}) as"
            f" scaled_loss:` did: {self.call}(loss, loss_id={loss_id}, optimizers=optimizer)",
        )

    def _reached(self, loss: Tensor) -> set[int]:
        """The optimizers whose parameters the autograd graph of ``loss`` reaches; it stops at the second."""
        reached: set[int] = set()
        seen: set[Any] = set()
        stack = [loss.grad_fn]
        while stack and len(reached) < 2:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)  # an AccumulateGrad node: the parameter it accumulates into
            if leaf is not None:
                reached |= self._owners.get(id(leaf), set())
            stack.extend(next_node for next_node, _ in node.next_functions)
        return reached
