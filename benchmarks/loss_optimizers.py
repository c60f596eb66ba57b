"""What choosing a loss's optimizers costs (``lightning_ddp_amp.amp.loss_optimizers``): the walk of the loss's autograd
graph, beside one training step of the models it walks.

    python benchmarks/loss_optimizers.py              # PyTorch's DCGAN example at 64x64, batch 16, on the CPU

The walk runs only where the rule looks: several optimizers set up and no ``optimizers=``. A discriminator's loss is
walked whole (it reaches one optimizer); a generator's loss through the discriminator stops at the second optimizer
it reaches (and is refused). Prints microseconds per walk and milliseconds per forward and backward of both models.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from lightning_ddp_amp.amp.loss_optimizers import LossOptimizers

NZ, NGF, NDF, BATCH, WALKS, STEPS = 100, 64, 64, 16, 500, 3


def dcgan() -> tuple[nn.Module, nn.Module]:
    """The generator and discriminator of PyTorch's DCGAN example (64x64 RGB)."""

    def up(cin: int, cout: int, *args: int) -> list[nn.Module]:
        return [nn.ConvTranspose2d(cin, cout, 4, *args, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)]

    def down(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 4, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, True)]

    generator = nn.Sequential(
        *up(NZ, NGF * 8, 1, 0),
        *up(NGF * 8, NGF * 4, 2, 1),
        *up(NGF * 4, NGF * 2, 2, 1),
        *up(NGF * 2, NGF, 2, 1),
        nn.ConvTranspose2d(NGF, 3, 4, 2, 1, bias=False),
        nn.Tanh(),
    )
    discriminator = nn.Sequential(
        nn.Conv2d(3, NDF, 4, 2, 1, bias=False),
        nn.LeakyReLU(0.2, True),
        *down(NDF, NDF * 2),
        *down(NDF * 2, NDF * 4),
        *down(NDF * 4, NDF * 8),
        nn.Conv2d(NDF * 8, 1, 4, 1, 0, bias=False),
    )
    return generator, discriminator


def main() -> None:
    generator, discriminator = dcgan()
    chooser = LossOptimizers("fabric.backward")
    chooser.add([torch.optim.Adam(discriminator.parameters()), torch.optim.Adam(generator.parameters())])
    noise = torch.randn(BATCH, NZ, 1, 1)
    fake = generator(noise)
    losses = {
        "errD_fake (one optimizer)": discriminator(fake.detach()).mean(),
        "errG (two)": discriminator(fake).mean(),
    }
    for name, loss in losses.items():
        start = time.perf_counter()
        for _ in range(WALKS):
            chooser._reached(loss)
        print(f"{name}: {(time.perf_counter() - start) / WALKS * 1e6:.1f} us per walk")
    start = time.perf_counter()
    for _ in range(STEPS):
        discriminator(generator(noise)).mean().backward()
    print(f"forward and backward of both models: {(time.perf_counter() - start) / STEPS * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
