"""AmpPrecision for Lightning Fabric: the AMP backends of the Trainer's plugin, behind Fabric's precision hooks.

``Fabric(strategy="envddp", precision="apex-O1")`` runs the apex recipe in a kept loop::

    model, optimizer = fabric.setup(model, optimizer)   # amp.initialize(model, optimizer), then the DDP wrap
    fabric.backward(loss)                               # with amp.scale_loss(loss, optimizer) as s: s.backward()
    optimizer.step()                                    # apex's step: skipped after an overflow

The backends (:mod:`lightning_ddp_amp.amp.apex_backend`, :mod:`~lightning_ddp_amp.amp.native_backend`) are the
Trainer's; this module only answers Fabric's hooks. Fabric hands a precision plugin no optimizer at backward, so the
optimizers come from :meth:`AmpPrecision.connect`, which envddp calls before it wraps the models.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, Literal

import torch
from lightning.fabric.accelerators.cuda import CUDAAccelerator
from lightning.fabric.accelerators.mps import MPSAccelerator
from lightning.fabric.plugins import Precision
from lightning.fabric.utilities import rank_zero_info
from torch import Tensor
from torch.nn import Module, ModuleList
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_ddp_amp import _lightning
from lightning_ddp_amp.amp.backend import AmpBackend, Placement, backend_names, choose_backend
from lightning_ddp_amp.amp.loss_optimizers import LossOptimizers
from lightning_ddp_amp.amp.settings import AmpOptions, AmpSettings, check_choice, check_half_steps, settings_of
from lightning_ddp_amp.errors import PrecisionConfigurationError
from lightning_ddp_amp.precision_strings import OptLevel, resolve_flag

SETUP_MODELS = "lightning_ddp_amp.fabric.setup_models(fabric, [model_a, model_b], optimizer)"


class AmpPrecision(Precision):
    """Mixed precision with NVIDIA apex amp or native torch AMP for Lightning Fabric, in the apex recipe's order.

    The Trainer's :class:`lightning_ddp_amp.AmpPrecision` with Fabric's hooks; its arguments mean the same (there is
    no ``models``: Fabric is handed the models themselves, see :func:`~lightning_ddp_amp.fabric.setup_models`).

    Args:
        opt_level: apex's optimization level, ``"O0"`` … ``"O3"``.
        backend: ``"apex"`` (NVIDIA apex required), ``"native"`` (torch.amp) or ``"auto"``.
        **options: ``amp.initialize``'s other options (``keep_batchnorm_fp32``, ``loss_scale``, ``num_losses``,
            ``min_loss_scale``, ``max_loss_scale``, ``cast_model_outputs``) and the native backend's ``dtype``:
            :class:`~lightning_ddp_amp.amp.settings.AmpOptions`. With ``num_losses=2``, pass ``loss_id`` to
            ``fabric.backward``.

    Raises:
        PrecisionConfigurationError: An argument is invalid or the combination cannot run.
        ApexUnavailableError: ``backend="apex"`` and apex amp cannot be imported.
    """

    def __init__(
        self,
        opt_level: OptLevel = AmpSettings.opt_level,
        backend: Literal["auto", "apex", "native"] = "auto",
        **options: Unpack[AmpOptions],
    ) -> None:
        check_choice("backend", backend, ("auto", *backend_names()))
        #: The AMP options, checked, as the backends read them.
        self.settings = settings_of(opt_level, options)
        self._requested_backend = backend
        self.backend, self._backend_class, self._passed_over = choose_backend(backend, self.settings)
        self.precision = self._backend_class.lightning_precision(self.settings)  # type: ignore[assignment]
        self._built: AmpBackend | None = None
        self._device_type: str | None = None
        self._converted: list[Module] = []
        self._connected: list[Module] = []
        self._optimizers = LossOptimizers("fabric.backward")
        self._unscaled: set[int] = set()
        self._accumulating = 0
        self._skipped: dict[int, bool] = {}

    def __repr__(self) -> str:
        return f"AmpPrecision(backend={self.backend!r}, opt_level={self.opt_level!r})"

    @property
    def opt_level(self) -> OptLevel:
        """apex's optimization level, ``"O0"`` … ``"O3"``."""
        return self.settings.opt_level

    @property
    def flag(self) -> str:
        """The ``Fabric(precision=...)`` string of what runs, for messages: ``"apex-O1"``, ``"native-O2"``, ...; under
        ``backend="auto"`` (``"amp-O1"``) the backend it chose, so that a fix naming it asks for that backend."""
        return f"{self.backend}-{self.opt_level}"

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 master copies of half-precision model weights (apex O2)."""
        return self._backend_class.master_weights(self.settings)

    @property
    def initializes_with_optimizers(self) -> bool:
        """Whether the models must be handed over together with their optimizers, before any DDP wrap (apex)."""
        return self.backend == "apex"

    @property
    def amp_backend(self) -> AmpBackend:
        """The backend the hooks hand over to: apex's or torch.amp's, built once the device is known."""
        if self._built is None:
            device = self._device_type or ("cuda" if torch.cuda.is_available() else "cpu")
            self._built = self._backend_class.from_settings(self.settings, device)
        return self._built

    def check_fabric_setup(self, strategy: object, accelerator: object) -> None:
        """Check that Fabric can run this plugin with ``strategy`` on ``device_type``; called when Fabric is built.

        ``backend="auto"`` chooses again now that both are known, as on the Trainer.

        Raises:
            ApexUnavailableError: apex on a device other than CUDA.
            PrecisionConfigurationError: apex with a strategy that wraps the model in DDP before ``amp.initialize``.
        """
        self._device_type = device_type = (
            "cuda"
            if isinstance(accelerator, CUDAAccelerator)
            else "mps"
            if isinstance(accelerator, MPSAccelerator)
            else "cpu"
        )
        name = getattr(strategy, "strategy_name", type(strategy).__name__)
        # Fabric calls no precision hook with the optimizers: only a strategy that does (envddp) can run apex.
        placement = Placement(device_type, name, not getattr(strategy, "connects_precision_before_wrap", False))
        if self._requested_backend == "auto" and self._built is None:
            self.backend, self._backend_class, self._passed_over = choose_backend("auto", self.settings, placement)
            self.precision = self._backend_class.lightning_precision(self.settings)  # type: ignore[assignment]
        else:
            try:
                self._backend_class.check_placement(self.settings, placement)
            except PrecisionConfigurationError as error:
                raise PrecisionConfigurationError(
                    "strategy",
                    name,
                    f"Fabric(precision={self.flag!r}): {error.problem}",
                    f'use Fabric(strategy="envddp", precision={self.flag!r}), which calls amp.initialize first',
                ) from None
        rank_zero_info(self.computes())

    def computes(self) -> str:
        """What this plugin computes, as the one line Fabric's rank 0 prints when it is built: the backend and what the
        level means there, why ``backend="auto"`` passed over apex, and, at a ``*-mixed`` level, that inputs and outputs
        keep their dtypes, where Fabric's own ``16-mixed`` / ``bf16-mixed`` casts them."""
        why = f"{'; '.join(self._passed_over)}, so " if self._passed_over else ""
        line = f"AmpPrecision: {why}opt_level {self.opt_level} runs on {self._backend_class.describe(self.settings)}"
        if str(self.precision).endswith("-mixed"):
            line += (
                "; the inputs and outputs keep the dtypes the script and the model make, as in the apex recipe (Fabric's"
                f" own {self.precision!r} casts floating inputs to {self.settings.dtype} and outputs to float32)"
            )
        return line

    @override
    def convert_module(self, module: Module) -> Module:
        """Cast the model where the native backend casts it (O3), before Fabric moves it; apex casts in
        :meth:`connect`. Every model set up so far keeps its casts (a backend casts all its models at once)."""
        if not self.initializes_with_optimizers and module not in self._converted:
            self._converted.append(module)
            self.amp_backend.convert_module(ModuleList(self._converted), list(self._converted))
        return module

    def connect(self, models: Sequence[Module], optimizers: Sequence[Optimizer], call: str) -> None:
        """``amp.initialize(models, optimizers)``: the models and their raw optimizers, before any DDP wrap.

        Args:
            models: The models, on their device.
            optimizers: Their optimizers (not Fabric's wrappers).
            call: What the script called, for messages.

        Raises:
            PrecisionConfigurationError: apex amp was already initialized in this process, or an optimizer's ``eps``
                rounds to 0 in the half-precision weights it would step (O3).
        """
        if self.initializes_with_optimizers and getattr(self.amp_backend, "initialized", False):
            raise PrecisionConfigurationError(
                "call",
                call,
                f"under precision {self.flag!r} it would call amp.initialize again, but apex supports one"
                " amp.initialize per process and an earlier setup in this process made it",
                f"set up every model with its optimizer in one call: fabric.setup(model, optimizer), or {SETUP_MODELS}",
            )
        if not self.master_weights:  # before amp.initialize, so that the call can be made again with the fix
            o2 = f"precision={self.flag.rpartition('-')[0] + '-O2'!r}"
            dtype = self._backend_class.model_dtype(self.settings)
            check_half_steps(dtype, models, optimizers, f"{call} under precision {self.flag!r}", o2)
        self._optimizers.add(optimizers)  # before amp.initialize, which may swap O2's parameters for masters
        self.amp_backend.connect(ModuleList(models), list(models), list(optimizers))
        amp = getattr(self.amp_backend, "amp", None)
        if amp is not None:
            _refuse_fabric_optimizers(amp)
        self._connected.extend(models)

    def models_wrapped(self) -> None:
        """The connected models are wrapped in DDP (every rank holds rank 0's weights): apex O2 takes them into its
        fp32 masters, as the recipe's first backward after the wrap does; envddp calls this."""
        if self._built is not None:
            self._built.models_wrapped()

    def connected(self, item: Module | Optimizer) -> bool:
        """Whether the model or optimizer ``item`` went through :meth:`connect`."""
        return any(item is known for known in (*self._connected, *self._optimizers.optimizers))

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """While the script accumulates (``fabric.no_backward_sync``): backward keeps apex's gradients scaled."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    @override
    def convert_input(self, data: Any) -> Any:
        return self.amp_backend.convert_input(data)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with self.amp_backend.forward_context():
            yield

    @override
    def backward(
        self,
        tensor: Tensor,
        model: Module | None,
        *args: Any,
        loss_id: int = 0,
        optimizers: Optimizer | Sequence[Optimizer] | None = None,
        delay_unscale: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """``fabric.backward(loss)``: backward on the scaled loss, inside ``amp.scale_loss`` for apex.

        Args:
            tensor: The loss.
            model: The model Fabric names, unused.
            *args: Passed on to ``Tensor.backward``.
            loss_id: Which loss scaler scales this loss (``num_losses=2`` gives a second loss its own).
            optimizers: The optimizers this loss is scaled for, as the classic ``amp.scale_loss(loss, optimizers)``
                named them (Fabric's or the raw ones). Default: the one optimizer set up, or the one whose
                parameters the loss reaches (:mod:`~lightning_ddp_amp.amp.loss_optimizers`).
            delay_unscale: Keep apex from unscaling, as apex's accumulation recipe does on the micro-batches that do
                not step. Default: inside ``fabric.no_backward_sync(model)``, else not (the micro-batch that steps).
            **kwargs: Passed on to ``Tensor.backward``.

        Raises:
            PrecisionConfigurationError: ``loss_id`` is not one of the ``num_losses`` scalers, or the loss reaches the
                parameters of several optimizers and ``optimizers`` does not name them.
        """
        self.settings.check_loss_id(loss_id)
        chosen = self._optimizers.choose(tensor, optimizers, loss_id)

        def run_backward(scaled: Tensor) -> None:
            scaled.backward(*args, **kwargs)  # type: ignore[no-untyped-call]

        if delay_unscale is None:
            delay_unscale = self._accumulating > 0
        self.amp_backend.backward(tensor, chosen, run_backward, loss_id, delay_unscale)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale before clipping (native; apex unscaled when ``amp.scale_loss`` exited); once per step."""
        if id(optimizer) not in self._unscaled:
            self._unscaled.add(id(optimizer))
            self.amp_backend.unscale(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` on the raw optimizer: apex's patched step (skipped after an overflow), or the
        GradScaler's."""
        if self.amp_backend.scales_loss:
            self.unscale_gradients(optimizer)
        self._unscaled.discard(id(optimizer))
        result, self._skipped[id(optimizer)] = self.amp_backend.step(optimizer, **kwargs)
        return result

    def step_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last step of ``optimizer`` (Fabric's or the raw one) was skipped because of an overflow."""
        return self._skipped.get(id(getattr(optimizer, "optimizer", optimizer)), False)

    @property
    def may_skip_steps(self) -> bool:
        """Whether a dynamic loss scaler can skip a step on overflow."""
        return self.amp_backend.may_skip_steps

    @property
    def current_loss_scale(self) -> float | None:
        """The scale the next backward multiplies the loss by (the first loss scaler's); None without loss scaling."""
        return self.amp_backend.current_loss_scale()

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:  # type: ignore[override]
        """The parameters the optimizer steps: apex O2's fp32 masters, which clipping must see."""
        return self.amp_backend.main_params(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The loss scalers, and under apex O2 the fp32 master weights: put the plugin into ``fabric.save``'s state."""
        return {"backend": self.backend, "opt_level": self.opt_level, **self.amp_backend.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the loss scale(s) and apex O2's fp32 master weights (``fabric.load`` after ``fabric.setup``).

        Raises:
            PrecisionConfigurationError: The state was not written by AmpPrecision.
        """
        if not {"backend", "loss_scalers"} <= state_dict.keys():
            raise PrecisionConfigurationError(
                "state",
                sorted(state_dict),
                "it lacks 'backend' and 'loss_scalers': it was not written by AmpPrecision",
                "load the entry fabric.save wrote for the precision plugin (fabric.strategy.precision)",
            )
        self.amp_backend.load_state_dict(state_dict)

    @override
    def teardown(self) -> None:
        if self._built is not None:
            self._built.teardown()


def resolve_precision_flag(precision: object, plugins: Any) -> tuple[object, Any]:
    """``Fabric(precision="apex-O1")`` / ``"amp-O1"`` / ``"native-O1"`` as an :class:`AmpPrecision` in ``plugins``
    (:func:`~lightning_ddp_amp.precision_strings.resolve_flag`)."""
    return resolve_flag(precision, plugins, AmpPrecision, Precision, _lightning.precision_values())


#: apex's calls a kept line of the classic loop may hand Fabric's optimizer wrapper to, and what replaces each.
_APEX_CALLS = {
    "scale_loss": "replace `with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()` by"
    " fabric.backward(loss), which runs amp.scale_loss on the raw optimizer",
    "initialize": "drop the amp.initialize call: fabric.setup(model, optimizer) (or setup_models) made it already,"
    " before the DDP wrap",
}


def _refuse_fabric_optimizers(amp: ModuleType) -> None:
    """Make ``amp.scale_loss`` and ``amp.initialize`` refuse Fabric's optimizer wrapper, which a kept line of the
    classic loop would hand them: apex patches the object it is given (``step``, to skip it after an overflow), and a
    patch on the wrapper would bypass the strategy. Idempotent; the package's own calls hand over raw optimizers."""
    for name, fix in _APEX_CALLS.items():
        original = getattr(amp, name)
        if not getattr(original, "__refuses_fabric_optimizers__", False):
            setattr(amp, name, _refusing(name, original, fix))


def _refusing(name: str, original: Callable[..., Any], fix: str) -> Callable[..., Any]:
    """apex's ``amp.<name>``, refusing Fabric's optimizer wrapper with ``fix``."""

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if _lightning.is_fabric_optimizer(item):
                    raise PrecisionConfigurationError(
                        f"amp.{name}",
                        type(item).__name__,
                        "it was handed Fabric's optimizer wrapper (what fabric.setup returns); apex patches the object"
                        " it is given, and a patch on the wrapper would bypass Fabric's strategy",
                        fix,
                    )
        return original(*args, **kwargs)

    call.__refuses_fabric_optimizers__ = True  # type: ignore[attr-defined]
    return call
