"""The classic script (examples/classic/train.py) with its hand-written loop kept, under Lightning Fabric: envddp
reads the launcher, apex amp runs as before, and a dozen lines changed (docs/fabric.md shows the diff). It also logs
a validation accuracy, val_acc, with fabric.log every few steps and at the end, which `lightning-ddp-amp compare
--metric val_acc:0.005` compares between precisions (docs/compare.md).

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


def labels(x: torch.Tensor) -> torch.Tensor:
    return (x[:, :10].argmax(dim=1) + (x[:, 10] > 0).long()) % 10


def validate(fabric: Fabric, model_a: torch.nn.Module, model_b: torch.nn.Module, x: torch.Tensor, step: int) -> float:
    """Log as val_acc the share of ``x`` the two models classify right; no gradients and no random numbers, so the
    training goes on exactly as without it."""
    with torch.no_grad():
        accuracy = (model_b(model_a(x)).argmax(dim=1) == labels(x)).float().mean().item()
    fabric.log("val_acc", accuracy, step=step)
    return accuracy


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
    parser.add_argument("--val-every", type=int, default=4, help="optimizer steps between two val_acc")
    args = parser.parse_args()

    fabric = Fabric(strategy="envddp", precision=args.precision)
    fabric.launch()

    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    y = labels(x)
    dataset = TensorDataset(x, y)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=32, shuffle=True))

    model_a, model_b = Encoder(), Head()
    optimizer = torch.optim.SGD(list(model_a.parameters()) + list(model_b.parameters()), lr=args.lr)
    [model_a, model_b], optimizer = setup_models(fabric, [model_a, model_b], optimizer)
    # Drawn from a generator of its own: the global random numbers the training draws stay the classic script's.
    x_val = fabric.to_device(torch.randn(1024, 32, generator=torch.Generator().manual_seed(1)))

    state = {"model_a": model_a, "model_b": model_b, "optimizer": optimizer, "amp": fabric.strategy.precision}
    state["epoch"] = 0  # the epochs done
    if args.resume:
        fabric.load(args.resume, state)
    steps = state["epoch"] * (len(loader) // args.accumulate)  # the optimizer steps done

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
                steps += 1
                if steps % args.val_every == 0:
                    validate(fabric, model_a, model_b, x_val, steps)
        fabric.print(f"epoch {epoch}: loss {loss.item():.4f}")
        state["epoch"] = epoch + 1
        fabric.save(args.checkpoint, state)
    fabric.print(f"val_acc {validate(fabric, model_a, model_b, x_val, steps):.4f}")


if __name__ == "__main__":
    main()
