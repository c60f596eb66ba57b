"""A checkpoint written under apex amp, resumed under another precision: what crosses, and in what shape.

AmpPrecision writes its state under its class name, and beside it Lightning's ``MixedPrecision`` entry in
``torch.amp.GradScaler``'s shape, so that torch's AMP (AmpPrecision's native backend, or Lightning's
``16-mixed``) continues with apex's loss scale. Nothing here knows Lightning's plugins by class: the Trainer's and
Fabric's precision plugins are described by their name, their ``precision`` and whether they scale the loss.
"""

from __future__ import annotations

from typing import Any

#: The checkpoint entry AmpPrecision's state is saved under (Lightning keys a precision plugin's state by its class).
STATE_KEY = "AmpPrecision"


def grad_scaler_state(scaler: dict[str, float]) -> dict[str, float]:
    """One of AmpPrecision's loss scalers (``loss_scale``, ``unskipped``) as ``torch.amp.GradScaler.state_dict()``.

    apex's dynamic scaler and torch's default GradScaler follow the same rule (double after 2000 clean steps, halve
    on overflow), so only the scale and the count of clean steps move.
    """
    return {
        "scale": float(scaler["loss_scale"]),
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": int(scaler["unskipped"]),
    }


def describe_crossing(checkpoint: dict[str, Any], target: str, scales_loss: bool, reads_scale: bool) -> str | None:
    """What crosses, and what does not, when a checkpoint written under apex amp resumes under ``target``.

    Args:
        checkpoint: The checkpoint being resumed.
        target: The precision it resumes under, as the message names it; not apex amp.
        scales_loss: Whether that precision scales the loss at all.
        reads_scale: Whether it reads the checkpoint's loss scale (AmpPrecision's native backend, or Lightning's
            ``MixedPrecision`` when the checkpoint holds its entry).

    Returns:
        The line to log, or None when the checkpoint was not written by AmpPrecision under apex.
    """
    state = checkpoint.get(STATE_KEY)
    if not isinstance(state, dict) or state.get("backend") != "apex":
        return None
    carried, dropped = [], []
    if state.get("fp32_weights"):
        carried.append("apex O2's fp32 master weights (the checkpoint's weights)")
    elif state.get("rebuild_masters"):
        carried.append("the weights (a classic apex O2 checkpoint's fp16 weights: it saved no fp32 masters)")
    elif state.get("opt_level") == "O3":
        carried.append("the weights (fp16 under apex O3)")
    else:
        carried.append("the fp32 weights")
    scalers = state.get("loss_scalers") or []
    if scalers and scales_loss and reads_scale:
        carried.append(f"the loss scale {scalers[0]['loss_scale']:g}")
    elif scalers:
        dropped.append(
            f"the loss scale {scalers[0]['loss_scale']:g} ({target} {'starts its own' if scales_loss else 'scales no loss'})"
        )
    if len(scalers) > 1:
        dropped.append(f"the loss scales of loss_id 1 to {len(scalers) - 1} (one scaler scales every loss here)")
    message = f"Resuming a checkpoint of apex amp {state.get('opt_level', '')} under {target}: carried {', '.join(carried) or 'nothing'}"
    return message + (f"; dropped {'; '.join(dropped)}" if dropped else "")


def crossing_into(checkpoint: dict[str, Any], plugin: object) -> str | None:
    """:func:`describe_crossing` into one of Lightning's own precision plugins (``32-true``, ``16-mixed``, ...)."""
    return describe_crossing(
        checkpoint,
        f"{type(plugin).__name__}(precision={getattr(plugin, 'precision', None)!r})",
        scales_loss=getattr(plugin, "scaler", None) is not None,
        reads_scale="MixedPrecision" in checkpoint,
    )
