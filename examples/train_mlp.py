"""The 30-second demo: the classic DDP recipe as `Trainer(strategy="envddp")`.

    torchrun --nproc-per-node=2 examples/train_mlp.py     # 2 ranks on the CPU (gloo)
    python examples/train_mlp.py                          # the same script, one process

Synthetic regression data; every rank reports the shard it trained on, rank 0 the final loss.
"""

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_ddp_amp  # noqa: F401  (registers "envddp")


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.samples = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.samples += len(x)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    L.seed_everything(0)
    x = torch.randn(2048, 16)
    y = (x[:, :4].sum(dim=1, keepdim=True)).sin()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

    model = Regressor()
    trainer = L.Trainer(
        strategy="envddp",
        accelerator="cpu",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader)
    print(
        f"rank {trainer.global_rank}/{trainer.world_size} (launched by"
        f" {trainer.strategy.topology.launcher}, pid {os.getpid()}): trained on {model.samples} samples"
    )
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss'].item():.4f}")


if __name__ == "__main__":
    main()
