"""NVIDIA apex's DCGAN example (apex/examples/dcgan/main_amp.py) at toy size, by hand and converted: the pairs
tests/test_gan_reference.py holds to the same bits.

The example's recipe: two models and two optimizers through one
``amp.initialize([netD, netG], [optD, optG], num_losses=3)``, each model in its own DDP, and three losses with a loss
scaler each: the discriminator's on real images (``loss_id=0``) and on fakes (``loss_id=1``) step ``optD``; the
generator's (``loss_id=2``, through the discriminator) steps ``optG``.

``--door classic``: the script as users write it (torchrun's variables, gloo, a ``DistributedSampler`` with
``set_epoch``, ``amp.scale_loss``). ``--door fabric``: the same script with as few lines changed as possible
(``Fabric(strategy="envddp", plugins=[AmpPrecision(...)])``, ``setup_models``, ``fabric.setup_dataloaders``,
``fabric.backward(loss, loss_id=...)``). ``--door trainer``: a LightningModule with manual optimization and
``manual_backward(loss, loss_id=...)``.

The same bits in every door: the generator's noise comes with each sample (the dataset yields ``(image, noise)``),
since Lightning draws from the global RNG where a plain loop does not; every door shuffles with the classic script's
``DistributedSampler`` (Fabric and Lightning keep a sampler the script made, and call its ``set_epoch``), since in one
process envddp keeps a DataLoader's own sampler, whose ``shuffle=True`` order would come from that global RNG; and
overflows are injected by multiplying a loss by inf at a fixed step (by 1.0, which is bit-exact, at every other
step): errD_real at step OVERFLOW_AT["optD"], errG at step OVERFLOW_AT["optG"], under O1 and O2. O3 has a static
loss scale of 1 and skips no step: nothing is injected there.

Each rank saves OUT/rank<RANK>.pt (atomically): ``parameters`` and ``buffers`` (``netD.*``, ``netG.*``, in the
dtype they are stored in), ``masters`` (``amp.master_params`` of each optimizer: O2's fp32 masters),
``amp`` (``amp.state_dict()``: every loss scaler), ``skipped`` (the steps each optimizer skipped), ``overflow_at``,
``initial`` (the fp32 parameters before ``amp.initialize``) and ``dtypes`` (what the first layer of each model
computed in, in training). ``--cuda`` runs on cuda:LOCAL_RANK (NCCL between ranks), with real apex
(scripts/gpu_check.sh).
"""

import argparse
import os
from typing import Any

import torch
from common import save_complete
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

NZ, NGF, NDF, NC, IMAGE = 8, 8, 8, 1, 8  # noise size, feature maps of G and D, channels, image side
TRAIN_SIZE, BATCH, EPOCHS = 32, 4, 2
SEED, LR, BETAS = 0, 2e-3, (0.5, 0.999)
REAL_LABEL, FAKE_LABEL = 1.0, 0.0
#: The step (counted over epochs) whose loss is multiplied by inf: errD_real's (optD skips) and errG's (optG skips).
OVERFLOW_AT = {"optD": 2, "optG": 5}

parser = argparse.ArgumentParser()
parser.add_argument("--door", required=True, choices=["classic", "fabric", "trainer"])
parser.add_argument("--level", required=True, choices=["O1", "O2", "O3"])
parser.add_argument("--out", required=True)
parser.add_argument("--seed-per-rank", action="store_true", help="each rank builds its models from SEED + RANK")
parser.add_argument("--ddp-impl", default="torch", choices=["torch", "apex"])
parser.add_argument("--cuda", action="store_true", help="cuda:LOCAL_RANK and NCCL instead of the CPU and gloo")
parser.add_argument(
    "--strategy",
    default=None,
    help="the trainer door's strategy (default: envddp, searching for unused parameters on several ranks)",
)
args = parser.parse_args()
if args.door == "trainer" and args.ddp_impl == "apex":
    parser.error(
        "--door trainer --ddp-impl apex: apex's DistributedDataParallel around the one LightningModule takes one"
        " backward per forward, and this training_step makes three (errD_real, errD_fake, errG); run the trainer"
        " door with --ddp-impl torch"
    )
if args.cuda:
    # cuBLAS reads this when CUDA starts; without it deterministic algorithms refuse to run matmuls.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False),  # 1x1 -> 4x4
            nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False),  # 4x4 -> 8x8
            nn.BatchNorm2d(NGF),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF, NC, 3, 1, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        return self.main(noise)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False),  # 8x8 -> 4x4
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),  # 4x4 -> 2x2
            nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 2, 1, 0, bias=False),  # 2x2 -> 1x1: a logit (BCEWithLogitsLoss, as apex's example)
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.main(image).view(-1, 1).squeeze(1)


def weights_init(module: nn.Module) -> None:
    """The DCGAN example's initialization."""
    if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.normal_(module.weight, 1.0, 0.02)
        nn.init.zeros_(module.bias)


def build_models(rank: int) -> tuple[nn.Module, nn.Module]:
    """netD and netG, from SEED (or SEED + rank with --seed-per-rank: the ranks start apart, DDP makes them one)."""
    torch.manual_seed(SEED + rank if args.seed_per_rank else SEED)
    netG = Generator()
    netG.apply(weights_init)
    netD = Discriminator()
    netD.apply(weights_init)
    return netD, netG


def adams(netD: nn.Module, netG: nn.Module) -> tuple[torch.optim.Adam, torch.optim.Adam]:
    # O3 steps the fp16 weights themselves, where Adam's default eps (1e-8) rounds to 0; the package refuses it there.
    eps = {"eps": 1e-4} if args.level == "O3" else {}
    return (
        torch.optim.Adam(netD.parameters(), lr=LR, betas=BETAS, **eps),
        torch.optim.Adam(netG.parameters(), lr=LR, betas=BETAS, **eps),
    )


def gan_set() -> TensorDataset:
    """(image, noise) pairs: each sample carries the noise the generator turns into its fake."""
    generator = torch.Generator().manual_seed(1)
    images = torch.tanh(2 * torch.randn(TRAIN_SIZE, NC, IMAGE, IMAGE, generator=generator))
    return TensorDataset(images, torch.randn(TRAIN_SIZE, NZ, 1, 1, generator=generator))


def overflow(step: int, optimizer: str) -> float:
    """The factor the loss that steps ``optimizer`` is multiplied by at ``step``: inf where an overflow is injected."""
    return float("inf") if args.level != "O3" and step == OVERFLOW_AT[optimizer] else 1.0


criterion = nn.BCEWithLogitsLoss()


class Record:
    """What a run saves besides its weights: the weights it started from, the steps each optimizer skipped, and the
    dtype the first layer of each model computed in."""

    def __init__(self, netD: nn.Module, netG: nn.Module) -> None:
        self.initial = {name: tensor.detach().cpu().clone() for name, tensor in named(netD, netG, "parameters")}
        self.skipped: dict[str, list[int]] = {"optD": [], "optG": []}
        self.dtypes: dict[str, set[str]] = {"netD": set(), "netG": set()}
        for name, model in (("netD", netD), ("netG", netG)):
            model.main[0].register_forward_hook(self.hook(name))

    def hook(self, name: str) -> Any:
        def record(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if module.training:
                self.dtypes[name].add(str(output.dtype))

        return record

    def step(self, optimizer: str, step: int, skipped: bool) -> None:
        if skipped:
            self.skipped[optimizer].append(step)

    def save(self, netD: nn.Module, netG: nn.Module, optD: Any, optG: Any, rank: int) -> None:
        from apex import amp

        tensors = {part: dict(named(netD, netG, part)) for part in ("parameters", "buffers")}
        state = {part: {k: v.detach().cpu().clone() for k, v in found.items()} for part, found in tensors.items()}
        state["masters"] = {
            name: [p.detach().cpu().clone() for p in amp.master_params(getattr(opt, "optimizer", opt))]
            for name, opt in (("optD", optD), ("optG", optG))
        }
        state["amp"] = {scaler: dict(values) for scaler, values in amp.state_dict().items()}
        state["skipped"] = self.skipped
        state["overflow_at"] = OVERFLOW_AT if args.level != "O3" else {}
        state["initial"] = self.initial
        state["dtypes"] = {name: sorted(dtypes) for name, dtypes in self.dtypes.items()}
        save_complete(state, os.path.join(args.out, f"rank{rank}.pt"))


def named(netD: nn.Module, netG: nn.Module, part: str) -> list[tuple[str, torch.Tensor]]:
    """``netD.<name>`` and ``netG.<name>`` of the models' parameters or buffers."""
    return [
        (f"{prefix}.{name}", tensor)
        for prefix, model in (("netD", netD), ("netG", netG))
        for name, tensor in getattr(model, f"named_{part}")()
    ]


def classic() -> None:
    import torch.distributed as dist
    from apex import amp

    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if args.cuda else "gloo")

    netD, netG = build_models(rank)
    netD, netG = netD.to(device), netG.to(device)
    record = Record(netD, netG)
    optD, optG = adams(netD, netG)
    [netD, netG], [optD, optG] = amp.initialize([netD, netG], [optD, optG], opt_level=args.level, num_losses=3)
    models = netD, netG
    if world_size > 1:
        if args.ddp_impl == "apex":
            from apex.parallel import DistributedDataParallel as DDP

            netD, netG = DDP(netD), DDP(netG)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            device_ids = [local_rank] if args.cuda else None
            netD, netG = DDP(netD, device_ids=device_ids), DDP(netG, device_ids=device_ids)

    dataset = gan_set()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for real, noise in loader:
            real, noise = real.to(device), noise.to(device)
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            label = torch.full((real.shape[0],), REAL_LABEL, device=device)
            errD_real = criterion(netD(real), label) * overflow(step, "optD")
            with amp.scale_loss(errD_real, optD, loss_id=0) as errD_real_scaled:
                errD_real_scaled.backward()
            fake = netG(noise)
            label.fill_(FAKE_LABEL)
            errD_fake = criterion(netD(fake.detach()), label)
            with amp.scale_loss(errD_fake, optD, loss_id=1) as errD_fake_scaled:
                errD_fake_scaled.backward()
            record.step("optD", step, optD._amp_stash.already_patched)  # apex's flag: this step() is a skip
            optD.step()
            # (2) Update G: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(REAL_LABEL)
            errG = criterion(netD(fake), label) * overflow(step, "optG")
            with amp.scale_loss(errG, optG, loss_id=2) as errG_scaled:
                errG_scaled.backward()
            record.step("optG", step, optG._amp_stash.already_patched)
            optG.step()
            step += 1

    record.save(*models, optD, optG, rank)
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


def fabric() -> None:
    from lightning.fabric import Fabric

    from lightning_ddp_amp.fabric import AmpPrecision, EnvDDPStrategy, setup_models

    strategy = EnvDDPStrategy(ddp_impl="apex") if args.ddp_impl == "apex" else "envddp"
    fabric = Fabric(
        strategy=strategy,
        accelerator="cuda" if args.cuda else "cpu",
        plugins=[AmpPrecision(args.level, backend="apex", num_losses=3)],
    )
    fabric.launch()
    rank = fabric.global_rank

    netD, netG = build_models(rank)
    record = Record(netD, netG)
    optD, optG = adams(netD, netG)
    models = netD, netG
    [netD, netG], optD, optG = setup_models(fabric, [netD, netG], optD, optG)

    dataset = gan_set()
    sampler = DistributedSampler(dataset, num_replicas=fabric.world_size, rank=rank, shuffle=True)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=BATCH, sampler=sampler))
    skipped = fabric.strategy.precision.step_skipped
    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for real, noise in loader:
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            label = torch.full((real.shape[0],), REAL_LABEL, device=fabric.device)
            errD_real = criterion(netD(real), label) * overflow(step, "optD")
            fabric.backward(errD_real, loss_id=0)
            fake = netG(noise)
            label.fill_(FAKE_LABEL)
            errD_fake = criterion(netD(fake.detach()), label)
            fabric.backward(errD_fake, loss_id=1)
            optD.step()
            record.step("optD", step, skipped(optD))
            # (2) Update G: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(REAL_LABEL)
            errG = criterion(netD(fake), label) * overflow(step, "optG")
            fabric.backward(errG, loss_id=2, optimizers=optG)  # errG reaches netD's parameters too
            optG.step()
            record.step("optG", step, skipped(optG))
            step += 1

    record.save(*models, optD, optG, rank)


def trainer() -> None:
    import lightning as L

    from lightning_ddp_amp import AmpPrecision

    class DCGAN(L.LightningModule):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.netD, self.netG = build_models(rank)
            self.record = Record(self.netD, self.netG)
            self.step_count = 0

        def configure_amp_models(self) -> list[nn.Module]:
            return [self.netD, self.netG]

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return list(adams(self.netD, self.netG))

        def training_step(self, batch: Any, batch_idx: int) -> None:
            real, noise = batch
            opt_d, opt_g = self.optimizers()
            skipped = self.trainer.precision_plugin.step_skipped
            step = self.step_count
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            self.netD.zero_grad()
            label = torch.full((real.shape[0],), REAL_LABEL, device=self.device)
            errD_real = criterion(self.netD(real), label) * overflow(step, "optD")
            self.manual_backward(errD_real, loss_id=0)
            fake = self.netG(noise)
            label.fill_(FAKE_LABEL)
            errD_fake = criterion(self.netD(fake.detach()), label)
            self.manual_backward(errD_fake, loss_id=1)
            opt_d.step()
            self.record.step("optD", step, skipped(opt_d.optimizer))
            # (2) Update G: maximize log(D(G(z)))
            self.netG.zero_grad()
            label.fill_(REAL_LABEL)
            errG = criterion(self.netD(fake), label) * overflow(step, "optG")
            self.manual_backward(errG, loss_id=2, optimizers=opt_g)
            opt_g.step()
            self.record.step("optG", step, skipped(opt_g.optimizer))
            self.step_count += 1

    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    trainer = L.Trainer(
        # One DDP around both models: errD_real and errD_fake leave netG's parameters unused.
        strategy=args.strategy or ("envddp_find_unused_parameters_true" if world_size > 1 else "envddp"),
        accelerator="cuda" if args.cuda else "cpu",
        plugins=[AmpPrecision(args.level, backend="apex", num_losses=3)],
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DCGAN(rank)
    dataset = gan_set()  # the classic script's sampler: see the module's docstring
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    trainer.fit(model, DataLoader(dataset, batch_size=BATCH, sampler=sampler))
    model.record.save(model.netD, model.netG, *trainer.optimizers, trainer.global_rank)


{"classic": classic, "fabric": fabric, "trainer": trainer}[args.door]()
