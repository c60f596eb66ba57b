"""A plain Lightning training script for ``lightning-ddp-amp compare`` tests; it never imports lightning_ddp_amp.

Run as the user would (``python compare_train.py --lr 0.1``); compare changes its Trainer from the outside.
"""

import argparse
import os
import subprocess
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

try:
    from common import dataset
except ImportError:  # imported as tests.workers.compare_train
    from tests.workers.common import dataset


class Gain(torch.nn.Module):
    """Multiplies by ``gain`` and divides by it again, at the steps in ``at`` (every step when ``at`` is empty and
    ``gain`` is not 1): a layer built to overflow where its intermediate leaves the dtype's range (1e5 in float16, 1e39
    in float32), at one step or at each, as a model with a badly scaled layer does; elsewhere it changes nothing."""

    def __init__(self, gain: float, at: frozenset[int]) -> None:
        super().__init__()
        self.gain, self.at = gain, at
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.gain) / self.gain if self.gain != 1 and (not self.at or self.step in self.at) else x


class Regression(L.LightningModule):
    def __init__(
        self,
        lr: float,
        crash_at: int | None,
        crash_once: bool = False,
        gain: float = 1.0,
        gain_at: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__()
        self.crash_once = crash_once
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), Gain(gain, gain_at), torch.nn.Linear(16, 1)
        )
        self.lr = lr
        self.crash_at = crash_at

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.global_step == self.crash_at and (first_attempt or not self.crash_once):
            raise RuntimeError(f"the model crashed at step {self.global_step}")
        x, y, _ = batch
        self.net[2].step = self.global_step
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y, _ = batch
        prediction = self.net(x).float()
        self.log("val_loss", torch.nn.functional.mse_loss(prediction, y))
        self.log("val_within", ((prediction - y).abs() < 0.5).float().mean())

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y, _ = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x).float(), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def build(
    lr: float,
    seeded: bool = True,
    crash_at: int | None = None,
    crash_once: bool = False,
    gain: float = 1.0,
    gain_at: frozenset[int] = frozenset(),
) -> tuple[Regression, DataLoader]:
    """The model and loader, built in the order the script builds them (the tests' plain loop reuses it)."""
    if seeded:
        torch.manual_seed(0)
    model = Regression(lr, crash_at, crash_once, gain, gain_at)
    return model, DataLoader(dataset(64, seed=1), batch_size=8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--crash-once", action="store_true", help="crash only in torchrun's first attempt")
    parser.add_argument("--min-steps", type=int)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--validate-after", action="store_true", help="trainer.validate after fit, as scripts do")
    parser.add_argument("--helper-raises", action="store_true", help="start a helper process that fails, then train")
    parser.add_argument("--val-every", type=int, help="validate every N training batches during fit")
    parser.add_argument("--test-after", action="store_true", help="trainer.test after fit")
    parser.add_argument("--gain", type=float, default=1.0, help="the gain of net.2, the layer built to overflow")
    parser.add_argument("--gain-at", type=int, nargs="*", default=[], help="the steps it applies at (default: all)")
    args = parser.parse_args()
    if args.helper_raises:  # a probe that fails, as `python -c "import apex"` does without apex
        subprocess.run([sys.executable, "-c", "raise ValueError('the helper failed')"], check=False)
    model, loader = build(args.lr, True, args.crash_at, args.crash_once, args.gain, frozenset(args.gain_at))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=args.strategy,
        precision=args.precision,
        max_epochs=args.epochs,
        val_check_interval=args.val_every,
        num_sanity_val_steps=0,
        min_steps=args.min_steps,
        logger=L.pytorch.loggers.CSVLogger("script_logs"),
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath="script_checkpoints", every_n_train_steps=5)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    validation = DataLoader(dataset(32, seed=2), batch_size=8) if args.val_every else None
    trainer.fit(model, loader, validation)
    if args.validate_after:
        trainer.validate(model, loader)
    if args.test_after:
        trainer.test(model, DataLoader(dataset(32, seed=3), batch_size=8))


if __name__ == "__main__":
    main()
