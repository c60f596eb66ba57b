"""The private Lightning API that lightning_ddp_amp relies on: the functions of ``_lightning.py``, and the protected
members its subclasses of Lightning's classes inherit (``_lightning.INHERITED``). CI runs this file against the
lowest and the highest Lightning release the package declares, so a Lightning change breaks here first."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.data import _replace_dunder_methods
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops import _TrainingEpochLoop
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from lightning.pytorch.utilities import CombinedLoader
from packaging.version import Version
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

import lightning_ddp_amp
from lightning_ddp_amp import AmpPrecision, EnvDDPStrategy, _lightning
from lightning_ddp_amp.trainer.precision import resolve_precision_flag

DATASET = TensorDataset(torch.arange(8))


def test_tested_range_covers_the_installed_lightning() -> None:
    from packaging.version import Version

    low, high = _lightning.TESTED_LIGHTNING
    assert low <= Version(L.__version__) < high


def test_trainer_hook_is_installed_once() -> None:
    from lightning_ddp_amp import fabric

    hooked = _AcceleratorConnector.__init__
    _lightning.install_trainer_hook(resolve_precision_flag, EnvDDPStrategy, AmpPrecision, fabric.EnvDDPStrategy)
    assert _AcceleratorConnector.__init__ is hooked


class FlagRecordingStrategy(EnvDDPStrategy):
    """Test double: envddp, recording what the hook passes to ``check_trainer_flags``."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: dict[str, Any] = {}

    def check_trainer_flags(self, devices: Any, num_nodes: int, use_distributed_sampler: bool) -> None:
        self.flags = {"devices": devices, "num_nodes": num_nodes, "use_distributed_sampler": use_distributed_sampler}


def test_trainer_hook_passes_the_raw_devices_and_num_nodes() -> None:
    default, explicit = FlagRecordingStrategy(), FlagRecordingStrategy()
    L.Trainer(strategy=default, accelerator="cpu", logger=False)
    L.Trainer(strategy=explicit, accelerator="cpu", devices=1, logger=False, use_distributed_sampler=False)
    assert default.flags == {"devices": "auto", "num_nodes": 1, "use_distributed_sampler": True}
    assert explicit.flags == {"devices": 1, "num_nodes": 1, "use_distributed_sampler": False}


def test_trainer_env_defaults_are_what_the_trainer_takes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "7")
    monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")
    assert _lightning.trainer_env_defaults(L.Trainer) == {"max_steps": 7, "accelerator": "cpu"}
    assert L.Trainer(logger=False).max_steps == 7


def test_the_dummy_logger_is_a_logger_that_swallows_whatever_is_logged_through_it() -> None:
    logger = _lightning.DummyLogger()
    assert isinstance(logger, L.pytorch.loggers.Logger)
    logger.log_metrics({"loss": 1.0})
    logger.experiment.log({"anything": 1})  # what a script calls on its own logger's experiment
    assert logger.any_method_at_all(1) is None


def test_sampler_injection_flag_round_trips() -> None:
    trainer = L.Trainer(accelerator="cpu", logger=False, use_distributed_sampler=False)
    assert _lightning.sampler_injection(trainer) is False
    _lightning.set_sampler_injection(trainer, True)
    assert _lightning.sampler_injection(trainer) is True


class NamedLoader(DataLoader):
    """A DataLoader subclass with an argument of its own, as users write them."""

    def __init__(self, name: str, dataset: Any, **kwargs: Any) -> None:
        self.name = name
        super().__init__(dataset, **kwargs)


def test_rebuild_keeps_the_subclass_and_its_arguments() -> None:
    with _replace_dunder_methods(DataLoader, "dataset"):  # what Lightning does around `*_dataloader` hooks
        loader = NamedLoader("mine", DATASET, batch_size=4, drop_last=True)
    sampler = SequentialSampler(range(4))
    rebuilt = _lightning.rebuild_dataloader(loader, sampler, batch_size=2)
    assert isinstance(rebuilt, NamedLoader)
    assert (rebuilt.name, rebuilt.batch_size, rebuilt.drop_last, rebuilt.sampler) == ("mine", 2, True, sampler)


def test_rebuild_replaces_a_positional_batch_size() -> None:
    with _replace_dunder_methods(DataLoader, "dataset"):
        loader = DataLoader(DATASET, 4)
    rebuilt = _lightning.rebuild_dataloader(loader, SequentialSampler(DATASET), batch_size=1)
    assert rebuilt.batch_size == 1
    assert len(list(rebuilt)) == 8


def test_trainer_hook_reads_the_connector_arguments_it_hands_on() -> None:
    parameters = inspect.signature(_AcceleratorConnector.__init__).parameters
    assert {"precision", "plugins", "devices", "num_nodes", "use_distributed_sampler"} <= parameters.keys()


class SetupRecordingPrecision(AmpPrecision):
    """Test double: AmpPrecision, recording what the hook passes to ``check_trainer_setup``."""

    seen: tuple[Any, Any] | None = None

    def check_trainer_setup(self, strategy: Any, accelerator: Any) -> None:
        self.seen = (strategy, accelerator)


def test_trainer_hook_hands_the_finished_strategy_and_accelerator_to_the_precision_plugin() -> None:
    plugin = SetupRecordingPrecision(backend="native")
    trainer = L.Trainer(accelerator="cpu", plugins=[plugin], logger=False)
    assert plugin.seen == (trainer.strategy, trainer.accelerator)


class AsksNothing(SingleDeviceStrategy):
    """Test double: a strategy of the user's own whose methods share the names of envddp's Trainer checks."""

    def check_trainer_flags(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the hook asked a strategy that is not envddp")

    def _configure_launcher(self) -> None:
        self._launcher = StartsNothing()


class StartsNothing:
    """Test double: a launcher whose question shares the name of envddp's launcher's."""

    is_interactive_compatible = True

    @property
    def starts_ranks(self) -> bool:
        raise AssertionError("the hook asked the launcher of a strategy that is not envddp")


class ChecksNothing(Precision):
    """Test double: a precision plugin of the user's own with a method named as AmpPrecision's Trainer check."""

    def check_trainer_setup(self, *args: Any) -> None:
        raise AssertionError("the hook asked a precision plugin that is not AmpPrecision")


def test_trainer_hook_asks_only_the_packages_own_strategy_and_precision_plugin() -> None:
    trainer = L.Trainer(strategy=AsksNothing("cpu"), plugins=[ChecksNothing()], logger=False)
    assert (type(trainer.strategy), type(trainer.precision_plugin)) == (AsksNothing, ChecksNothing)


TORCHRUN = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}
#: Trainers that never ask for envddp or AmpPrecision, and the launcher variables they are built under.
LIGHTNINGS_OWN = {
    "defaults": ({"accelerator": "cpu"}, {}),
    "ddp": ({"accelerator": "cpu", "strategy": "ddp", "devices": 2}, {}),
    "ddp-under-torchrun": ({"accelerator": "cpu", "strategy": "ddp", "devices": 2}, TORCHRUN),
    "bf16-mixed": ({"accelerator": "cpu", "precision": "bf16-mixed", "devices": 1}, {}),
    "explicit-defaults": ({"accelerator": "cpu", "strategy": "auto", "devices": 1, "num_nodes": 1}, {}),
}


def _built(kwargs: dict[str, Any]) -> tuple[Any, ...]:
    trainer = L.Trainer(logger=False, **kwargs)
    strategy = trainer.strategy
    environment = getattr(strategy, "cluster_environment", None)
    return (
        type(trainer.accelerator),
        type(strategy),
        getattr(strategy, "parallel_devices", None),
        type(trainer.precision_plugin),
        trainer.precision_plugin.precision,
        type(environment),
        type(trainer.accelerator).__module__.split(".")[0],
        type(strategy).__module__.split(".")[0],
        type(trainer.precision_plugin).__module__.split(".")[0],
        type(environment).__module__.split(".")[0],
    )


@pytest.mark.parametrize(("kwargs", "environ"), LIGHTNINGS_OWN.values(), ids=LIGHTNINGS_OWN.keys())
def test_a_trainer_that_never_asks_for_the_package_is_built_by_lightning_alone(
    kwargs: dict[str, Any], environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    hooked = _built(kwargs)
    monkeypatch.setattr(_AcceleratorConnector, "__init__", _AcceleratorConnector.__init__.__wrapped__)
    assert hooked == _built(kwargs)
    assert set(hooked[-4:]) <= {"lightning", "builtins"}  # builtins: a strategy without a cluster environment


def test_optimizers_to_device_moves_the_state_an_optimizer_holds() -> None:
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1, momentum=0.9)
    parameter.grad = torch.ones(2)
    optimizer.step()
    _lightning.optimizers_to_device([optimizer], torch.device("meta"))
    assert optimizer.state[parameter]["momentum_buffer"].device.type == "meta"


class AskingLauncher:
    """Test double: a launcher that answers the fence's question about the fit it is handed, and runs nothing."""

    is_interactive_compatible = True

    def __init__(self) -> None:
        self.answers: list[bool] = []

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("trainer", None)
        self.answers.append(_lightning.launched_with_ckpt_path(function, args, kwargs))

    def kill(self, signum: Any) -> None:
        """Nothing to kill."""


def test_launched_with_ckpt_path_tells_whether_the_fit_handed_to_a_launcher_was_given_one(tmp_path: Path) -> None:
    trainer = _quiet_trainer()
    launcher = AskingLauncher()
    trainer.strategy._launcher = launcher  # type: ignore[assignment]
    model, loader = BoringModel(), DataLoader(torch.randn(4, 32))
    trainer.fit(model, loader)
    trainer.fit(model, loader, ckpt_path=tmp_path / "by_name.ckpt")
    trainer.fit(model, loader, None, None, tmp_path / "in_place.ckpt")
    assert launcher.answers == [False, True, True]


#: Lightning broadcasts rank 0's SIGTERM flag at every training step from this release on.
SIGTERM_BROADCAST_SINCE = Version("2.5.2")
HAS_SIGTERM_BROADCAST = Version(L.__version__) >= SIGTERM_BROADCAST_SINCE
needs_sigterm_broadcast = pytest.mark.skipif(
    not HAS_SIGTERM_BROADCAST,
    reason=f"Lightning {L.__version__} has no per-step SIGTERM broadcast ({SIGTERM_BROADCAST_SINCE} added it)",
)


def test_the_sigterm_broadcast_exists_exactly_from_the_release_that_added_it() -> None:
    assert hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor") == HAS_SIGTERM_BROADCAST


@needs_sigterm_broadcast
def test_the_training_step_broadcasts_sigterm_through_the_method_the_fence_shadows() -> None:
    calls = [
        ast.unparse(node.func)
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(_TrainingEpochLoop.advance))))
        if isinstance(node, ast.Call)
    ]
    assert "self._broadcast_sigterm_tensor" in calls
    assert list(inspect.signature(_TrainingEpochLoop._broadcast_sigterm_tensor).parameters) == ["self"]


@needs_sigterm_broadcast
def test_disable_sigterm_broadcast_silences_only_the_given_trainers_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    silenced, other = L.Trainer(accelerator="cpu", logger=False), L.Trainer(accelerator="cpu", logger=False)
    broadcasts: list[Any] = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *args, **kwargs: broadcasts.append(args))
    _lightning.disable_sigterm_broadcast(silenced)
    silenced.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert broadcasts == []
    other.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert len(broadcasts) == 1


@pytest.mark.skipif(HAS_SIGTERM_BROADCAST, reason=f"Lightning {L.__version__} has the per-step SIGTERM broadcast")
def test_disable_sigterm_broadcast_leaves_a_loop_without_the_broadcast_untouched() -> None:
    trainer = L.Trainer(accelerator="cpu", logger=False)
    before = dict(vars(trainer.fit_loop.epoch_loop))
    _lightning.disable_sigterm_broadcast(trainer)
    assert vars(trainer.fit_loop.epoch_loop) == before


def _quiet_trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@needs_sigterm_broadcast
def test_an_envddp_fit_shadows_its_loops_sigterm_broadcast() -> None:
    trainer = _quiet_trainer(strategy="envddp", max_steps=1, limit_val_batches=0)
    trainer.fit(BoringModel())
    assert "_broadcast_sigterm_tensor" in vars(trainer.fit_loop.epoch_loop)


class HookCounter(Callback):
    def __init__(self) -> None:
        self.called: list[str] = []

    def on_before_backward(self, *args: Any) -> None:
        self.called.append("on_before_backward")

    def on_validation_batch_end(self, *args: Any) -> None:
        self.called.append("on_validation_batch_end")

    def on_train_batch_end(self, *args: Any) -> None:
        self.called.append("on_train_batch_end")


def test_a_silenced_callback_hook_is_not_called_and_the_others_still_are() -> None:
    silenced = type(
        "Silenced",
        (HookCounter,),
        _lightning.silenced_callback_hooks("on_before_backward", "on_after_backward", "on_validation_batch_end"),
    )
    callback = silenced()
    trainer = _quiet_trainer(max_steps=2, limit_val_batches=1, val_check_interval=1, callbacks=[callback])
    trainer.fit(BoringModel())
    assert callback.called == ["on_train_batch_end"] * 2
    callback = HookCounter()  # the same without the silenced hooks: they are called
    _quiet_trainer(max_steps=2, limit_val_batches=1, val_check_interval=1, callbacks=[callback]).fit(BoringModel())
    assert callback.called.count("on_before_backward") == 2 and "on_validation_batch_end" in callback.called


class ProgressRecorder(Callback):
    """Records the fence's view of the epoch's progress after each training batch (where checkpoints are saved)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen.append(_lightning.epoch_progress(trainer))


def test_epoch_progress_counts_the_batches_of_the_current_epoch_whose_step_is_done() -> None:
    recorder = ProgressRecorder()
    _quiet_trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=0, callbacks=[recorder]).fit(BoringModel())
    assert recorder.seen == [(1, 3), (2, 3), (3, 3)] * 2


class MovesTheEpochsBatches(Callback):
    """Moves the resumed epoch's count of batches when training starts (as the strategy's hook does), then records
    the batch indices Lightning trains."""

    def __init__(self, by: int) -> None:
        self.by = by
        self.seen: list[int] = []

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        _lightning.move_epoch_batches(trainer, self.by)

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(batch_idx)


@pytest.mark.parametrize(("by", "seen"), [(0, [2, 3]), (1, [3]), (-1, [1, 2, 3])])
def test_move_epoch_batches_moves_where_a_resumed_epoch_counts_from_and_so_where_it_ends(
    tmp_path: Path, by: int, seen: list[int]
) -> None:
    _checkpoints_of_one_four_batch_epoch(tmp_path, stateful=False)  # epoch=0-step=2.ckpt: 2 of 4 batches trained
    recorder = MovesTheEpochsBatches(by)
    trainer = _quiet_trainer(max_epochs=1, limit_val_batches=0, callbacks=[recorder])
    trainer.fit(
        BoringModel(), DataLoader(torch.randn(16, 32), batch_size=4), ckpt_path=tmp_path / "epoch=0-step=2.ckpt"
    )
    assert recorder.seen == seen
    assert trainer.global_step == 2 + len(seen)
    assert trainer.current_epoch == 1  # the epoch ended when the count reached the DataLoader's length


class HookRecorder(Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.calls += 1


def test_after_closure_runs_the_before_step_hooks_and_gradient_clipping() -> None:
    recorder = HookRecorder()
    trainer = _quiet_trainer(gradient_clip_val=1e-3, callbacks=[recorder])
    model = BoringModel()
    trainer.strategy.connect(model)
    model.trainer = trainer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    _lightning.after_closure(trainer.precision_plugin, model, optimizer)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert recorder.calls == 1
    assert norm.item() == pytest.approx(1e-3, rel=1e-3)


def test_make_stateful_makes_lightning_save_and_restore_the_loader_state() -> None:
    loader = DataLoader(DATASET)
    restored: list[dict[str, Any]] = []
    _lightning.make_stateful(loader, lambda: {"batches": 3}, restored.append)
    assert isinstance(loader, _Stateful)
    combined = CombinedLoader(loader, "max_size_cycle")
    assert combined._state_dicts() == [{"batches": 3}]
    combined._load_state_dicts([{"batches": 2}])
    assert restored == [{"batches": 2}]


def _checkpoints_of_one_four_batch_epoch(directory: Path, stateful: bool) -> dict[str, dict[str, Any]]:
    """The checkpoints a fit of one 4-batch epoch saves after batches 2 and 4, and at its end, by name."""
    loader = DataLoader(torch.randn(16, 32), batch_size=4)
    if stateful:
        _lightning.make_stateful(loader, lambda: {"position": "saved"}, lambda state: None)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)],
    )
    trainer.fit(BoringModel(), loader)
    trainer.save_checkpoint(directory / "end.ckpt")
    return {path.stem: torch.load(path, weights_only=False) for path in directory.glob("*.ckpt")}


def test_saved_mid_epoch_tells_a_checkpoint_inside_an_epoch_from_one_at_its_end(tmp_path: Path) -> None:
    saved = _checkpoints_of_one_four_batch_epoch(tmp_path, stateful=False)
    mid_epoch = {name: _lightning.saved_mid_epoch(checkpoint) for name, checkpoint in saved.items()}
    # After the last batch (step 4) the epoch is done, though Lightning has not closed it yet.
    assert mid_epoch == {"epoch=0-step=2": True, "epoch=0-step=4": False, "end": False}


def test_saved_loader_states_reads_the_states_lightning_saved_for_stateful_loaders(tmp_path: Path) -> None:
    with_states = _checkpoints_of_one_four_batch_epoch(tmp_path / "stateful", stateful=True)
    without = _checkpoints_of_one_four_batch_epoch(tmp_path / "plain", stateful=False)
    assert _lightning.saved_loader_states(with_states["epoch=0-step=2"]) == [{"position": "saved"}]
    assert _lightning.saved_loader_states(without["epoch=0-step=2"]) == []


def _keys(tree: object) -> object:
    return {key: _keys(value) for key, value in tree.items()} if isinstance(tree, dict) else None


def test_epoch_boundary_loops_have_the_layout_lightning_writes_and_are_read_as_epochs_and_steps_done(
    tmp_path: Path,
) -> None:
    written = _checkpoints_of_one_four_batch_epoch(tmp_path, stateful=False)["end"]
    loops = _lightning.epoch_boundary_loops(3, 12)
    assert _keys(loops) == _keys(written["loops"])
    assert _lightning.version() == written["pytorch-lightning_version"]
    trainer = L.Trainer(accelerator="cpu", max_epochs=5, logger=False, enable_progress_bar=False)
    trainer.fit_loop.load_state_dict(loops["fit_loop"])
    assert (trainer.current_epoch, trainer.global_step) == (3, 12)
    assert not _lightning.saved_mid_epoch({"loops": loops})


def test_is_loader_state_mismatch_recognises_lightnings_error() -> None:
    with pytest.raises(RuntimeError) as raised:
        CombinedLoader(DataLoader(DATASET), "max_size_cycle")._load_state_dicts([{"batches": 2}])
    assert _lightning.is_loader_state_mismatch(raised.value)
    assert not _lightning.is_loader_state_mismatch(RuntimeError("CUDA out of memory"))


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_unrepeated_sampler_gives_each_sample_to_exactly_one_rank(shuffle: bool) -> None:
    shards = [
        list(_lightning.UnrepeatedDistributedSampler(range(5), shuffle=shuffle, num_replicas=2, rank=rank, seed=0))
        for rank in range(2)
    ]
    assert sorted(shards[0] + shards[1]) == list(range(5))


def test_the_unrepeated_sampler_wrapper_shards_a_users_sampler_without_repeats() -> None:
    shards = [
        list(
            _lightning.UnrepeatedDistributedSamplerWrapper(
                SequentialSampler(range(5)), shuffle=False, num_replicas=2, rank=rank, seed=0
            )
        )
        for rank in range(2)
    ]
    assert sorted(shards[0] + shards[1]) == list(range(5))


def test_the_strategy_registry_type_is_the_type_of_lightnings_registry() -> None:
    assert isinstance(StrategyRegistry, _lightning.StrategyRegistryType)
    registry = _lightning.StrategyRegistryType()
    EnvDDPStrategy.register_strategies(registry)
    assert registry.available_strategies() == ["envddp", "envddp_find_unused_parameters_true"]


def test_each_registry_entry_names_the_strategy_class_registered() -> None:
    # The trainer hook tells a mistyped envddp by the class of the nearest registered name.
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_ddp_amp import fabric

    for name in ("envddp", "envddp_find_unused_parameters_true"):
        assert StrategyRegistry[name]["strategy"] is EnvDDPStrategy
        assert STRATEGY_REGISTRY[name]["strategy"] is fabric.EnvDDPStrategy


def _lightning_imports_from_modules_their_package_exports() -> list[str]:
    """``module:line name`` for each public Lightning name imported from a module file whose package has it too."""
    found = []
    root = Path(lightning_ddp_amp.__file__).parent
    for path in sorted([*root.glob("*.py"), *root.glob("_lightning/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning"):
                continue
            if hasattr(importlib.import_module(node.module), "__path__"):
                continue  # a package: the path Lightning exports its names on
            package = importlib.import_module(node.module.rpartition(".")[0])
            found += [
                f"{path.stem}:{node.lineno} {alias.name}" for alias in node.names if _public_on(package, alias.name)
            ]
    return found


def _public_on(package: Any, name: str) -> bool:
    return not _protected(name) and hasattr(package, name)


def test_lightning_names_are_imported_from_the_package_that_exports_them() -> None:
    assert _lightning_imports_from_modules_their_package_exports() == []


def _package_classes() -> Iterator[type[Any]]:
    """Every class the package defines (the one source of truth, not the ``pytorch_lightning`` flavour)."""
    for module in pkgutil.walk_packages(lightning_ddp_amp.__path__, "lightning_ddp_amp."):
        if module.ispkg or module.name.split(".")[1] in ("__main__", "pytorch_lightning") or "._site" in module.name:
            continue
        imported = importlib.import_module(module.name)
        for _, cls in inspect.getmembers(imported, inspect.isclass):
            if cls.__module__ == imported.__name__:
                yield cls


def _is_lightning(cls: type[Any]) -> bool:
    return cls.__module__.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")


def _protected(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _members_in_source(cls: type[Any]) -> set[str]:
    """Protected names a class's own source defines or uses on ``self``, ``cls`` or ``super()``."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (
                isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super"
            ):
                names.add(node.attr)
    return {name for name in names if _protected(name)}


def _lightning_members(cls: type[Any]) -> set[str]:
    """Protected members of the Lightning classes ``cls`` derives from: methods, and attributes set on ``self``."""
    bases = [base for base in cls.__mro__ if _is_lightning(base)]
    members = {name for base in bases for name in vars(base) if _protected(name)}
    for base in bases:
        try:
            members |= _members_in_source(base)
        except (OSError, TypeError):  # a class without Python source (typing.Protocol's machinery, say)
            continue
    return members


LIGHTNING_SUBCLASSES = [
    cls for cls in _package_classes() if not _is_lightning(cls) and any(map(_is_lightning, cls.__mro__))
]


def test_the_package_uses_exactly_the_inherited_members_it_declares() -> None:
    used: dict[type[Any], set[str]] = {base: set() for base in _lightning.INHERITED}
    for cls in LIGHTNING_SUBCLASSES:
        own = set().union(*(_members_in_source(c) for c in cls.__mro__ if c.__module__.startswith("lightning_ddp_amp")))
        inherited = own & _lightning_members(cls)
        declared_bases = [base for base in _lightning.INHERITED if issubclass(cls, base)]
        assert declared_bases or not inherited, f"{cls.__name__} uses {sorted(inherited)}: declare them in INHERITED"
        for base in declared_bases:
            used[base] |= inherited
    for base, declared in _lightning.INHERITED.items():
        assert (base.__name__, sorted(used[base])) == (base.__name__, sorted(declared))


@pytest.mark.parametrize(
    ("base", "name"), [(base, name) for base, names in _lightning.INHERITED.items() for name in names]
)
def test_each_declared_inherited_member_still_exists(base: type[Any], name: str) -> None:
    assert name in _lightning_members(base)


OVERRIDES = [
    (cls, name, base)
    for cls in LIGHTNING_SUBCLASSES
    for name in vars(cls)
    if _protected(name) and callable(vars(cls)[name])
    for base in [next((b for b in cls.__mro__[1:] if _is_lightning(b) and name in vars(b)), None)]
    if base is not None
]


@pytest.mark.parametrize(("cls", "name", "base"), OVERRIDES, ids=[f"{c.__name__}.{n}" for c, n, _ in OVERRIDES])
def test_each_protected_override_keeps_lightnings_parameters(cls: type[Any], name: str, base: type[Any]) -> None:
    ours, theirs = inspect.signature(getattr(cls, name)), inspect.signature(getattr(base, name))
    assert list(ours.parameters) == list(theirs.parameters)


def test_the_overrides_cover_the_hooks_a_ddp_reader_looks_for() -> None:
    overridden = {(cls.__name__, name) for cls, name, _ in OVERRIDES}
    assert {("EnvDDPStrategy", "_setup_model"), ("EnvDDPStrategy", "_configure_launcher")} <= overridden


LAUNCHERS = [cls for cls in _package_classes() if callable(getattr(cls, "launch", None)) and hasattr(cls, "kill")]


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=[cls.__name__ for cls in LAUNCHERS])
def test_each_launcher_has_every_member_of_lightnings_launcher_interface(launcher: type[Any]) -> None:
    for name in _Launcher.__abstractmethods__:
        assert hasattr(launcher, name), name
        theirs = getattr(_Launcher, name)
        if inspect.isfunction(theirs):
            ours = list(inspect.signature(getattr(launcher, name)).parameters)
            assert [each for each in ours if each in inspect.signature(theirs).parameters] == list(
                inspect.signature(theirs).parameters
            )


def test_precision_values_are_what_the_trainer_accepts() -> None:
    # Both connectors validate with this function; the package's hook refuses a string before Lightning would.
    from lightning.fabric.connector import _convert_precision_to_unified_args

    values = _lightning.precision_values()
    assert {"32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "32", "16", "bf16"} <= set(values)
    for value in values:
        _convert_precision_to_unified_args(value)  # type: ignore[arg-type]
    for value in ("32-true", "bf16-mixed", "64", "bf16"):
        L.Trainer(accelerator="cpu", precision=value, logger=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Precision 'apex-O4' is invalid"):
        _convert_precision_to_unified_args("apex-O4")  # type: ignore[arg-type]


def test_evaluation_metrics_are_what_this_validation_or_test_run_logged_and_not_trainings() -> None:
    class Logs(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            self.log("train_only", 1.0)
            return output

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_mean", float(batch_idx))  # mean over batches 0..3: 1.5
            self.log("val_both", 2.0, on_step=True, on_epoch=True)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_sum", 1.0, reduce_fx="sum")

    seen: dict[str, dict[str, float]] = {}

    class Reads(Callback):
        def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            if not trainer.sanity_checking:
                seen["validate"] = _lightning.evaluation_metrics(trainer)

        def on_test_end(self, trainer: L.Trainer, pl_module: Any) -> None:
            seen["test"] = _lightning.evaluation_metrics(trainer)

    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, limit_train_batches=2, limit_val_batches=4, limit_test_batches=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[Reads()],
    )  # fmt: skip
    trainer.fit(Logs())
    trainer.test(Logs(), verbose=False)
    assert seen["validate"] == {"val_mean": 1.5, "val_both": 2.0, "val_both_epoch": 2.0}
    assert seen["test"] == {"test_sum": 3.0}


def test_fabric_hook_is_installed_once() -> None:
    from lightning.fabric.connector import _Connector

    from lightning_ddp_amp import fabric
    from lightning_ddp_amp.fabric.precision import resolve_precision_flag as resolve_fabric_flag

    hooked = _Connector.__init__
    _lightning.install_fabric_hook(resolve_fabric_flag, fabric.EnvDDPStrategy, fabric.AmpPrecision, EnvDDPStrategy)
    assert _Connector.__init__ is hooked


def test_fabric_hook_reads_the_connector_arguments_it_hands_on() -> None:
    from lightning.fabric.connector import _Connector

    parameters = inspect.signature(_Connector.__init__).parameters
    assert {"precision", "plugins", "devices", "num_nodes"} <= parameters.keys()


def test_fabric_hook_hands_fabrics_raw_devices_and_num_nodes_to_envddp() -> None:
    from lightning.fabric import Fabric

    from lightning_ddp_amp import fabric

    class Recording(fabric.EnvDDPStrategy):
        flags: dict[str, Any] | None = None

        def check_fabric_flags(self, devices: Any, num_nodes: int) -> None:
            self.flags = {"devices": devices, "num_nodes": num_nodes}

    strategy = Recording()
    Fabric(strategy=strategy, accelerator="cpu", devices="auto", num_nodes=1)
    assert strategy.flags == {"devices": "auto", "num_nodes": 1}  # not the device count the connector made of it


def test_fabrics_optimizer_is_told_apart_and_keeps_a_zero_grad_patched_on_the_optimizer() -> None:
    from lightning.fabric.wrappers import _FabricOptimizer

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    calls: list[tuple[Any, ...]] = []
    optimizer.zero_grad = lambda *args: calls.append(args)  # type: ignore[method-assign]  # as apex O2 patches it
    _lightning.keep_fabric_zero_grad(optimizer)
    wrapped = _FabricOptimizer(optimizer, strategy=None)  # type: ignore[arg-type]
    assert _lightning.is_fabric_optimizer(wrapped) and not _lightning.is_fabric_optimizer(optimizer)
    wrapped.zero_grad()
    optimizer.zero_grad()
    assert calls == [(), ()]
    assert type(optimizer).__name__ == "SGD" and isinstance(optimizer, torch.optim.SGD)
