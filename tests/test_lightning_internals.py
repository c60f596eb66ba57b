"""The private Lightning API that lightning_ddp_amp._lightning relies on. CI runs this file against the lowest
and the highest Lightning release the package declares, so a Lightning change breaks here first."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.data import _replace_dunder_methods
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from lightning_ddp_amp import _lightning

DATASET = TensorDataset(torch.arange(8))


def test_tested_range_covers_the_installed_lightning() -> None:
    from packaging.version import Version

    low, high = _lightning.TESTED_LIGHTNING
    assert low <= Version(L.__version__) < high


def test_trainer_hook_is_installed_once() -> None:
    hooked = _AcceleratorConnector.__init__
    _lightning.install_trainer_hook()
    assert _AcceleratorConnector.__init__ is hooked


class FlagRecordingStrategy(SingleDeviceStrategy):
    """Test double: a strategy that records what the hook passes to ``check_trainer_flags``."""

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.flags: dict[str, Any] = {}

    def check_trainer_flags(self, devices: Any, num_nodes: int, use_distributed_sampler: bool) -> None:
        self.flags = {"devices": devices, "num_nodes": num_nodes, "use_distributed_sampler": use_distributed_sampler}


def test_trainer_hook_passes_the_raw_devices_and_num_nodes() -> None:
    default, explicit = FlagRecordingStrategy(), FlagRecordingStrategy()
    L.Trainer(strategy=default, logger=False)
    L.Trainer(strategy=explicit, devices=1, logger=False, use_distributed_sampler=False)
    assert default.flags == {"devices": "auto", "num_nodes": 1, "use_distributed_sampler": True}
    assert explicit.flags == {"devices": 1, "num_nodes": 1, "use_distributed_sampler": False}


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
