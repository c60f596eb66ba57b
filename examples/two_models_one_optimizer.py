"""examples/classic/train.py (DDP, a DistributedSampler and NVIDIA apex amp by hand, two sub-models sharing one
optimizer) rewritten for Lightning with envddp and AmpPrecision. Under the same command it ends in the same weights
(tests/test_examples.py checks it on 2 ranks).

    torchrun --nproc-per-node=8 examples/two_models_one_optimizer.py    # amp-O1: apex O1 on GPUs with apex
    torchrun --nproc-per-node=2 examples/two_models_one_optimizer.py    # on the CPU: torch's AMP O1
"""

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp import AmpPrecision  # importing the package registers "envddp", "apex-O*" and "amp-O*"


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.relu(x))


class TwoModels(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.model_a = Encoder()
        self.model_b = Head()
        self.lr = lr

    def configure_amp_models(self) -> list[torch.nn.Module]:
        # amp.initialize([model_a, model_b], optimizer): the models whose forward is called.
        return [self.model_a, self.model_b]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model_b(self.model_a(x)).float(), y)
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss  # backward runs inside amp.scale_loss (apex) or through the GradScaler (native)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # One optimizer over both models, as in the recipe.
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="amp-O1", help="apex-O*, amp-O*, native-O* or any Lightning value")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoints", default="runs/two_models_one_optimizer", help="the directory rank 0 saves to")
    parser.add_argument("--resume", help="a checkpoint to continue: one it saved, or one convert_apex_checkpoint wrote")
    # What `python -m torch.distributed.launch` without --use-env passes; envddp reads it, argparse must accept it.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = parser.parse_args()

    L.seed_everything(0)
    x = torch.randn(1024, 32)
    y = (x[:, :10].argmax(dim=1) + (x[:, 10] > 0).long()) % 10
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)  # sharded per rank by envddp

    trainer = L.Trainer(
        strategy="envddp",
        precision=args.precision,
        accelerator=args.accelerator,
        max_epochs=args.epochs,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=args.checkpoints)],  # rank 0 saves, with the amp state
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TwoModels(args.lr), loader, ckpt_path=args.resume)
    if trainer.is_global_zero:
        plugin = trainer.precision_plugin
        how = f"{plugin.backend} amp {plugin.opt_level}" if isinstance(plugin, AmpPrecision) else trainer.precision
        loss = trainer.callback_metrics["loss"].item()
        # What ran, which is not --precision where compare (or a config) gave the Trainer another one.
        print(f"trained under {how} on {trainer.world_size} rank(s); final loss {loss:.4f}")


if __name__ == "__main__":
    main()
