"""examples/classic/train.py with torch's AMP by hand instead of apex: the hand-written native O1 loop that
examples/fabric/train.py under ``precision="native-O1"`` is compared with (tests/test_fabric.py).

The same model, data, accumulation, clipping and inf batch; ``torch.autocast`` around the forward and the loss, a
``GradScaler`` around backward and step (unscaled once, before clipping), DDP and a DistributedSampler by hand. Run
under torchrun; rank 0 saves the weights and the scaler's state after each epoch.
"""

import argparse
import contextlib
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "fabric"))
from train import Encoder, Head  # the examples' models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--bad-batch", type=int, default=-1)
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    y = (x[:, :10].argmax(dim=1) + (x[:, 10] > 0).long()) % 10
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)

    model_a, model_b = Encoder(), Head()
    optimizer = torch.optim.SGD(list(model_a.parameters()) + list(model_b.parameters()), lr=args.lr)
    model_a, model_b = DDP(model_a), DDP(model_b)
    scaler = torch.amp.GradScaler("cpu")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            if epoch * len(loader) + step == args.bad_batch:
                x[0, 0] = float("inf")
            syncing = (step + 1) % args.accumulate == 0
            with contextlib.ExitStack() as stack:
                for model in (model_a, model_b) if not syncing else ():
                    stack.enter_context(model.no_sync())
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.cross_entropy(model_b(model_a(x)).float(), y) / args.accumulate
                scaler.scale(loss).backward()
            if syncing:
                if args.clip:
                    scaler.unscale_(optimizer)
                    params = [p for group in optimizer.param_groups for p in group["params"]]
                    torch.nn.utils.clip_grad_norm_(params, args.clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        if rank == 0:
            state = {"model_a": model_a.module.state_dict(), "model_b": model_b.module.state_dict()}
            torch.save({**state, "scaler": scaler.state_dict(), "epoch": epoch + 1}, args.checkpoint)  # epochs done
    del model_a, model_b, loss, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
