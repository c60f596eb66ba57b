"""The classic script (examples/classic/train.py) with its hand-written loop kept, under Lightning Fabric: envddp
reads the launcher, apex amp runs as before, and a dozen lines changed (docs/fabric.md shows the diff).

    torchrun --nproc-per-node=8 examples/fabric/train.py    # amp-O1: apex O1 on GPUs with apex
    torchrun --nproc-per-node=2 examples/fabric/train.py    # on the CPU: torch's AMP O1

--precision apex-O1 insists on apex, as the classic script does. The tests run it on CPU ranks with gloo and the apex
test double (tests/doubles), and check that it ends in the classic script's weights. After each epoch it saves
runs/fabric/checkpoint.pt, with the epochs done under "epoch" as the classic script saves them.
"""

import argparse
import contextlib

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp.fabric import setup_models


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="amp-O1", help="apex-O*, amp-O*, native-O* or any Lightning value")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", default="runs/fabric/checkpoint.pt")
    parser.add_argument("--resume", default="", help="a checkpoint this script saved")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    parser.add_argument("--clip", type=float, default=0.0, help="max gradient norm; 0: no clipping")
    parser.add_argument("--bad-batch", type=int, default=-1, help="the batch (counted over epochs) fed an inf")
    args = parser.parse_args()

    fabric = Fabric(strategy="envddp", precision=args.precision)
    fabric.launch()

    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    y = (x[:, :10].argmax(dim=1) + (x[:, 10] > 0).long()) % 10
    dataset = TensorDataset(x, y)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=32, shuffle=True))

    model_a, model_b = Encoder(), Head()
    optimizer = torch.optim.SGD(list(model_a.parameters()) + list(model_b.parameters()), lr=args.lr)
    [model_a, model_b], optimizer = setup_models(fabric, [model_a, model_b], optimizer)

    state = {"model_a": model_a, "model_b": model_b, "optimizer": optimizer, "amp": fabric.strategy.precision}
    state["epoch"] = 0  # the epochs done
    if args.resume:
        fabric.load(args.resume, state)

    for epoch in range(state["epoch"], args.epochs):
        loader.sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            if epoch * len(loader) + step == args.bad_batch:
                x[0, 0] = float("inf")  # apex skips the step its gradients overflow in
            syncing = (step + 1) % args.accumulate == 0
            with contextlib.ExitStack() as stack:
                for model in (model_a, model_b) if not syncing else ():
                    stack.enter_context(fabric.no_backward_sync(model))
                loss = torch.nn.functional.cross_entropy(model_b(model_a(x)).float(), y) / args.accumulate
                fabric.backward(loss)
            if syncing:
                if args.clip:
                    fabric.clip_gradients(model_a, optimizer, max_norm=args.clip)
                optimizer.step()
                optimizer.zero_grad()
        fabric.print(f"epoch {epoch}: loss {loss.item():.4f}")
        state["epoch"] = epoch + 1
        fabric.save(args.checkpoint, state)


if __name__ == "__main__":
    main()
