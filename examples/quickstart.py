"""The README's first example: a LightningModule trained by envddp under amp-O1, on any machine (README, "A first run")."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_ddp_amp  # noqa: F401  registers strategy="envddp" and precision="apex-O*" / "amp-O*"


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    L.seed_everything(0)
    x = torch.randn(512, 16)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32, shuffle=True)
    # amp-O1: NVIDIA apex amp O1 where apex can run (installed, on CUDA), torch.amp O1 elsewhere; one line says which.
    trainer = L.Trainer(strategy="envddp", precision="amp-O1", max_epochs=3, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), loader)
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss'].item():.4f} on {trainer.world_size} rank(s)")
