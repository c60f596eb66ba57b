"""TEST DOUBLE of ``apex/amp/lists/``: the functions O1 patches, by name (``functional_overrides.py``,
``torch_overrides.py``, ``tensor_overrides.py``), as apex 25.05 lists them. RNNs and RNN cells are on no list, in
apex as here: amp.py's ``init`` patches them afterwards (``rnn_compat.py``, wrap.py ``new_rnn_cast``).

``bmm``, ``baddbmm`` and ``addbmm`` are on the fp16 list, where apex puts them with CUDA 9.1 or later.
"""

from __future__ import annotations

import torch
import torch.nn.functional

# --- functional_overrides.py: torch.nn.functional --------------------------------------------------------------

FUNCTIONAL = torch.nn.functional

FUNCTIONAL_FP16 = [
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "linear",
]

FUNCTIONAL_FP32 = [
    # interpolation
    "interpolate",
    "grid_sample",
    # pointwise
    "softplus",
    "softmin",
    "log_softmax",
    "softmax",
    "gelu",
    # normalization
    "layer_norm",
    "group_norm",
    "local_response_norm",
    "normalize",
    "cosine_similarity",
    # losses
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "cross_entropy",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "multi_margin_loss",
    "nll_loss",
    "binary_cross_entropy_with_logits",
    "smooth_l1_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "ctc_loss",
]

#: An error when any argument is fp16, with apex's message (``BANNED_FUNCS``).
FUNCTIONAL_BANNED = [
    (
        "binary_cross_entropy",
        "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` "
        "It requires that the output of the previous function be already a FloatTensor. \n\n"
        "Most models have a Sigmoid right before BCELoss. In that case, you can use\n"
        "    torch.nn.BCEWithLogitsLoss\nto combine Sigmoid+BCELoss into a single layer "
        "that is compatible with amp.\nAnother option is to add\n"
        "    amp.register_float_function(torch, 'sigmoid')\nbefore calling `amp.init()`.\n"
        "If you _really_ know what you are doing, you can disable this warning by passing "
        "allow_banned=True to `amp.init()`.",
    )
]

# --- torch_overrides.py: torch ----------------------------------------------------------------------------------

TORCH = torch

TORCH_FP16 = [
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "mm",
    "mv",
    "addbmm",
    "baddbmm",
    "bmm",
]

TORCH_FP32 = [
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "cumprod",
    "cumsum",
    "dist",
    "norm",
    "prod",
    "std",
    "sum",
    "var",
    "renorm",
]

#: Multi-tensor functions: mixed fp16 and fp32 arguments are all cast to fp32.
TORCH_CASTS = [
    "addcdiv",
    "addcmul",
    "atan2",
    "cross",
    "bilinear",
    "dot",
    "add",
    "div",
    "mul",
    "eq",
    "equal",
    "ge",
    "gt",
    "le",
    "lt",
    "ne",
]

#: Functions of a sequence of tensors, promoted the same way.
TORCH_SEQUENCE_CASTS = ["cat", "stack"]

# --- tensor_overrides.py: torch.Tensor, with every torch_overrides name that Tensor also has -------------------

TENSOR = torch.Tensor


def _on_tensor(names: list[str]) -> list[str]:
    """compat.py ``filter_attrs`` on ``torch.Tensor``, as tensor_overrides.py builds its lists."""
    return [name for name in names if hasattr(TENSOR, name)]


TENSOR_FP16 = _on_tensor(["__matmul__", *TORCH_FP16])
TENSOR_FP32 = _on_tensor(["__ipow__", "__pow__", "__rpow__", "cpu", *TORCH_FP32])
TENSOR_CASTS = _on_tensor(
    [
        "__add__",
        "__div__",
        "__eq__",
        "__ge__",
        "__gt__",
        "__iadd__",
        "__idiv__",
        "__imul__",
        "__isub__",
        "__itruediv__",
        "__le__",
        "__lt__",
        "__mul__",
        "__ne__",
        "__radd__",
        "__rdiv__",
        "__rmul__",
        "__rsub__",
        "__rtruediv__",
        "__sub__",
        "__truediv__",
        *TORCH_CASTS,
    ]
)
TENSOR_SEQUENCE_CASTS = _on_tensor(TORCH_SEQUENCE_CASTS)
