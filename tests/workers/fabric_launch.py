"""``Fabric(strategy="envddp")`` as a script builds it: which rank this is, under any launcher or none
(tests/test_fabric.py). Each rank prints one JSON line: its rank, the world size, and a sum all-reduced over the
ranks. ``--devices 2`` without a launcher: ``fabric.launch()`` starts the ranks through torchrun."""

import argparse
import json

import torch
from lightning.fabric import Fabric

import lightning_ddp_amp  # noqa: F401  registers "envddp" for Fabric

parser = argparse.ArgumentParser()
parser.add_argument("--devices", default="auto")
args = parser.parse_args()

fabric = Fabric(
    strategy="envddp", accelerator="cpu", devices=args.devices if args.devices == "auto" else int(args.devices)
)
fabric.launch()
total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum")
line = {"rank": fabric.global_rank, "world": fabric.world_size, "local": fabric.local_rank, "sum": total.item()}
print(json.dumps(line), flush=True)
