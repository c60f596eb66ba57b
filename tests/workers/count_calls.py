"""Counts the calls into lightning_ddp_amp per training step: two fits, 4 and 12 steps, in the same processes.

Each rank writes OUT/rank<RANK>.json: {function: calls per step} for every function of the package whose call
count grows with the number of steps.
"""

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from common import LR, build_net, train_set
from torch.utils.data import DataLoader

import lightning_ddp_amp
from lightning_ddp_amp import AmpPrecision, EnvDDPStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--amp", action="store_true", help="train with AmpPrecision (native fp16)")
args = parser.parse_args()
PACKAGE = str(Path(lightning_ddp_amp.__file__).parent)
calls: Counter[str] = Counter()


def profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
        module = Path(frame.f_code.co_filename).stem
        calls[f"{module}.{frame.f_code.co_qualname}"] += 1


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit(steps: int) -> Counter[str]:
    calls.clear()
    trainer = L.Trainer(
        strategy=EnvDDPStrategy(),
        accelerator="cpu",
        max_steps=steps,
        plugins=[AmpPrecision(backend="native")] if args.amp else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    sys.setprofile(profile)
    trainer.fit(Module(), DataLoader(train_set(), batch_size=4, shuffle=True))
    sys.setprofile(None)
    return Counter(calls)


short, long = fit(4), fit(12)
per_step = {name: (long[name] - short[name]) / 8 for name in long if long[name] > short[name]}
Path(args.out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(per_step, indent=1, sort_keys=True))
