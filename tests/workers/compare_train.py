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


class Regression(L.LightningModule):
    def __init__(self, lr: float, crash_at: int | None, crash_once: bool = False) -> None:
        super().__init__()
        self.crash_once = crash_once
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.lr = lr
        self.crash_at = crash_at

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.global_step == self.crash_at and (first_attempt or not self.crash_once):
            raise RuntimeError(f"the model crashed at step {self.global_step}")
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x).float(), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def build(
    lr: float, seeded: bool = True, crash_at: int | None = None, crash_once: bool = False
) -> tuple[Regression, DataLoader]:
    """The model and loader, built in the order the script builds them (the tests' plain loop reuses it)."""
    if seeded:
        torch.manual_seed(0)
    model = Regression(lr, crash_at, crash_once)
    return model, DataLoader(dataset(64, seed=1), batch_size=8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--unseeded", action="store_true")
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--crash-once", action="store_true", help="crash only in torchrun's first attempt")
    parser.add_argument("--min-steps", type=int)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--validate-after", action="store_true", help="trainer.validate after fit, as scripts do")
    parser.add_argument("--helper-raises", action="store_true", help="start a helper process that fails, then train")
    args = parser.parse_args()
    if args.helper_raises:  # a probe that fails, as `python -c "import apex"` does without apex
        subprocess.run([sys.executable, "-c", "raise ValueError('the helper failed')"], check=False)
    model, loader = build(args.lr, seeded=not args.unseeded, crash_at=args.crash_at, crash_once=args.crash_once)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=args.strategy,
        precision=args.precision,
        max_epochs=args.epochs,
        min_steps=args.min_steps,
        logger=L.pytorch.loggers.CSVLogger("script_logs"),
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath="script_checkpoints", every_n_train_steps=5)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    if args.validate_after:
        trainer.validate(model, loader)


if __name__ == "__main__":
    main()
