"""A synthetic regression model and data module for the LightningCLI examples."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    """Two sub-models and one optimizer, like the classic apex recipe; ``configure_amp_models`` names them."""

    def __init__(self, hidden: int = 32, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU())
        self.head = torch.nn.Linear(hidden, 1)

    def configure_amp_models(self) -> list[torch.nn.Module]:
        return [self.encoder, self.head]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.encoder(x)).float(), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.head(self.encoder(x)).float(), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class RegressionData(L.LightningDataModule):
    def __init__(self, samples: int = 512, batch_size: int = 32) -> None:
        super().__init__()
        self.samples = samples
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 16, generator=generator)
        self.dataset = TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).sin())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)
