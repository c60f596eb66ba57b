"""Which modules the Trainer's AmpPrecision hands to ``amp.initialize``, as ``amp.initialize([model_a, model_b],
optimizer)`` named them: ``AmpPrecision(models=[...])``, the LightningModule's ``configure_amp_models()``, or the
LightningModule itself.

Only torch is needed here: a LightningModule is a ``torch.nn.Module`` whose sub-modules are its attributes.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.nn import Module

from lightning_ddp_amp.errors import PrecisionConfigurationError


def check_models(models: Sequence[str] | None) -> tuple[str, ...] | None:
    """``AmpPrecision(models=...)``: the attribute names of the sub-modules amp acts on, or None for the module.

    Raises:
        PrecisionConfigurationError: ``models`` is not a non-empty list of names.
    """
    if models is None:
        return None
    if isinstance(models, str) or not all(isinstance(m, str) and m for m in models) or not models:
        raise PrecisionConfigurationError(
            "models", models, "it must be a non-empty list of attribute names", "e.g. models=['model_a', 'model_b']"
        )
    return tuple(models)


def amp_modules(lightning_module: Module, models: tuple[str, ...] | None) -> list[Module]:
    """The modules handed to ``amp.initialize``: ``models``, ``configure_amp_models()``, or the module itself.

    Args:
        lightning_module: The LightningModule.
        models: ``AmpPrecision(models=...)``, checked (:func:`check_models`).

    Raises:
        PrecisionConfigurationError: a name does not lead to a module, both sources are given, or
            ``configure_amp_models()`` returns something other than modules.
    """
    configure = getattr(lightning_module, "configure_amp_models", None)
    if models is not None:
        if configure is not None:
            raise PrecisionConfigurationError(
                "models",
                list(models),
                f"{type(lightning_module).__name__} also defines configure_amp_models()",
                "choose one: drop AmpPrecision(models=...) or the configure_amp_models() method",
            )
        return [_submodule(lightning_module, name) for name in models]
    if configure is None:
        return [lightning_module]
    returned = configure()
    modules = [returned] if isinstance(returned, Module) else list(returned)
    if not modules or not all(isinstance(m, Module) for m in modules):
        raise PrecisionConfigurationError(
            "configure_amp_models()",
            [type(m).__name__ for m in modules],
            "it must return a non-empty sequence of torch.nn.Module",
            "return the sub-modules whose forward you call, e.g. [self.model_a, self.model_b]",
        )
    return modules


def _submodule(root: Module, name: str) -> Module:
    try:
        module = root.get_submodule(name)
    except AttributeError:
        children = ", ".join(n for n, _ in root.named_children()) or "none"
        raise PrecisionConfigurationError(
            "models",
            name,
            f"{type(root).__name__} has no sub-module of that name (its children: {children})",
            "name attributes of the LightningModule that hold torch.nn.Module, e.g. models=['model_a']",
        ) from None
    return module
