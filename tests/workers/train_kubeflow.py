"""One process per pod, as a Kubeflow PyTorchJob starts them: only RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
are set, and the script passes Lightning's KubeflowEnvironment, which Lightning cannot detect by itself.

Each rank writes OUT/rank<RANK>.json (the topology it trained with) and OUT/rank<RANK>.pt (its final weights).
"""

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from common import LR, build_net, train_set
from lightning.pytorch.plugins.environments import KubeflowEnvironment
from torch.utils.data import DataLoader

import lightning_ddp_amp  # noqa: F401  (registers "envddp")

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
out = Path(args.out)


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


trainer = L.Trainer(
    strategy="envddp",
    plugins=[KubeflowEnvironment()],
    accelerator="cpu",
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = Module()
trainer.fit(model, DataLoader(train_set(), batch_size=8, shuffle=True))

rank = os.environ["RANK"]
topology = trainer.strategy.topology
report = {
    "global_rank": trainer.global_rank,
    "world_size": trainer.world_size,
    "num_nodes": trainer.num_nodes,
    "local_rank": topology.local_rank,
    "local_world_size": topology.local_world_size,
    "node_rank": topology.node_rank,
    "launcher": topology.launcher,
    "environment": type(trainer.strategy.cluster_environment).__name__,
    "steps": trainer.global_step,
}
(out / f"rank{rank}.json").write_text(json.dumps(report))
torch.save({k: v.detach().cpu() for k, v in model.net.state_dict().items()}, out / f"rank{rank}.pt")
