"""TEST DOUBLE of ``apex.amp`` from NVIDIA apex 25.05 (see tests/doubles/README.md), not apex.

Laid out like apex's ``apex/amp``: ``frontend`` (``initialize``, ``state_dict``, ``load_state_dict``),
``_initialize`` (casting models, patching forward and ``state_dict``), ``_process_optimizer`` (stashes, fp32
master weights, patched ``step`` / ``zero_grad`` / ``add_param_group``), ``handle`` (``scale_loss``,
``disable_casts``), ``scaler`` (``LossScaler``), ``amp`` / ``wrap`` / ``lists`` / ``rnn_compat`` (O1's patching of
torch, and the user's registrations and decorators). It
computes for real, in fp16 on the CPU, where apex computes on CUDA; ``_amp_state.on_amp_device`` is where the
double reads apex's ``is_cuda``.

What real apex does not have is in ``double_extras`` and re-exported here: ``supports_cpu``, ``events``,
``backward_outside_scale_loss()`` and ``unpatch_torch_for_tests()``.
"""

from ._amp_state import _amp_state, master_params
from .amp import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from .double_extras import backward_outside_scale_loss, events, unpatch_torch_for_tests
from .frontend import initialize, load_state_dict, state_dict
from .handle import disable_casts, scale_loss

#: Real apex has no such flag. True: the double accepts CPU tensors as apex accepts CUDA ones, and
#: lightning_ddp_amp lets it run on the CPU. A test sets it to False to get apex's refusal of CPU parameters.
supports_cpu = True

__all__ = [
    "_amp_state",
    "backward_outside_scale_loss",
    "disable_casts",
    "events",
    "float_function",
    "half_function",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
    "supports_cpu",
    "unpatch_torch_for_tests",
]
