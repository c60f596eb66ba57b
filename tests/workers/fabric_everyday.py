"""Everyday Lightning Fabric under one precision, on 2 ranks: what users do around a Fabric loop
(test_fabric_everyday.py), all in one process.

``Fabric(strategy="envddp", ..., loggers=CSVLogger(...))``, ``fabric.launch()``; then, in order, each a *part* of the
report:

- ``setup``: a GAN (the generator and the discriminator of workers/everyday.py's ``SmallGAN``, an Adam optimizer
  each), the transformer (``SmallTransformer``'s layers) and the sequence model (``SmallSeq``'s layers and forward),
  each with its optimizer, set up in ONE ``setup_models`` call: apex supports one ``amp.initialize`` per process.
  Where that call is refused, the refusal is recorded as ``setup_refused`` and the call is made again as its
  message's fix says (apex O3: Adam's ``eps=1e-4``); then a second ``fabric.setup`` of another model, which apex
  must refuse (``second_setup_refused``) and every other precision runs.
- ``collectives``: ``fabric.all_reduce`` (sum, mean), ``fabric.all_gather`` of a tensor and of a dict,
  ``fabric.broadcast``, ``fabric.barrier``, ``fabric.print``.
- ``autocast``: the dtype of a float32 matmul outside and inside ``with fabric.autocast():``.
- ``gan``: steps with two optimizers and ``fabric.backward(loss, loss_id=..., optimizers=...)`` (loss_id only where the
  precision plugin is AmpPrecision, built with ``num_losses=2``; Lightning's own plugins take no ``loss_id``, and
  passing one is recorded as ``loss_id_refused``).
- ``transformer`` and ``seq``: training steps on a ``fabric.setup_dataloaders`` loader, then evaluation in eval mode
  under ``torch.no_grad()``; the sequence model's failure is recorded as ``seq_failed`` and the rest stands (torch's
  oneDNN has no LSTM for some dtypes under CPU autocast; the test asks torch).
- ``log``: ``fabric.log`` and ``fabric.log_dict`` into the CSVLogger, finalized.

``--precision``: a ``Fabric(precision=...)`` value (``32-true``, ``16-mixed``, ``bf16-mixed``), or ``amp-O*`` /
``apex-O*`` / ``native-O*``, which become ``plugins=[AmpPrecision(level, backend, num_losses=2)]``. Each rank writes
OUT/rank<RANK>.json; an exception is recorded there as ``error`` (its part, message and trace) and the rank fails.
"""

import argparse
import json
import os
import traceback
from pathlib import Path
from typing import Any

import torch
from everyday import SmallGAN, SmallSeq, SmallTransformer, images, sequences
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_ddp_amp.errors import LightningDDPAmpError
from lightning_ddp_amp.fabric import AmpPrecision, setup_models

STEPS = 3  # training steps of each model
BATCH = 4
TRAIN_SIZE = 2 * STEPS * BATCH  # STEPS batches a rank
EVAL_SIZE = 13  # not a multiple of 2: DistributedSampler pads rank 1's shard; 2 batches a rank


def precision_options(precision: str) -> dict[str, Any]:
    """Fabric's precision, as a value, or for this package's levels as an AmpPrecision with two loss scalers."""
    family, _, level = precision.partition("-")
    if family in ("apex", "amp", "native"):
        backend = {"native": "native", "apex": "apex", "amp": "auto"}[family]
        return {"plugins": [AmpPrecision(opt_level=level, backend=backend, num_losses=2)]}
    return {"precision": precision}


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class Recorder:
    """The dtype of a module's (first) output, by stage: in training, in evaluation."""

    def __init__(self, module: nn.Module) -> None:
        self.seen: dict[str, set[str]] = {"train": set(), "eval": set()}
        module.register_forward_hook(self.hook)

    def hook(self, module: nn.Module, args: Any, output: Any) -> None:
        tensor = output[0] if isinstance(output, tuple) else output
        self.seen["train" if module.training else "eval"].add(dtype_name(tensor))

    def report(self) -> dict[str, list[str]]:
        return {stage: sorted(dtypes) for stage, dtypes in self.seen.items()}


class Transformer(nn.Module):
    """workers/everyday.py's SmallTransformer as a plain module: its layers, images rows as tokens."""

    def __init__(self) -> None:
        super().__init__()
        source = SmallTransformer()
        self.embed, self.encoder, self.norm, self.head = source.embed, source.encoder, source.norm, source.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(x[:, 0]))  # each image row is a token
        return self.head(self.norm(hidden).mean(dim=1))


class Seq(nn.Module):
    """workers/everyday.py's SmallSeq as a plain module: its layers and its forward (Embedding, Linear, LSTM, GRU)."""

    def __init__(self) -> None:
        super().__init__()
        source = SmallSeq()
        self.embed, self.project, self.lstm, self.gru, self.head = (
            source.embed,
            source.project,
            source.lstm,
            source.gru,
            source.head,
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return SmallSeq.forward(self, tokens)


def finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(tensor.detach().float()).all()) for tensor in tensors)


def weights_finite(*models: nn.Module) -> bool:
    return all(finite(parameter) for model in models for parameter in model.parameters())


class Run:
    """One precision's Fabric run on this rank; ``report`` holds what happened, ``part`` the part running."""

    def __init__(self, precision: str, out: Path, report: dict[str, Any]) -> None:
        self.precision = precision
        self.out = out
        self.report = report
        self.part = "fabric"
        self.logged: dict[str, dict[str, float]] = {}  # step -> name -> value, as handed to fabric.log*

    def start(self, part: str) -> None:
        self.part = part
        self.report.setdefault("ran", []).append(part)

    def log(self, step: int, **values: torch.Tensor | float) -> None:
        """``fabric.log`` for one value, ``fabric.log_dict`` for several; remembered as float."""
        if len(values) == 1:
            ((name, value),) = values.items()
            self.fabric.log(name, value, step=step)
        else:
            self.fabric.log_dict(values, step=step)
        self.logged.setdefault(str(step), {}).update({name: float(value) for name, value in values.items()})

    def main(self) -> None:
        self.start("fabric")
        torch.manual_seed(0)
        logger = CSVLogger(self.out / "csv", name="fabric", version=0)
        self.fabric = fabric = Fabric(
            strategy="envddp", accelerator="cpu", loggers=logger, **precision_options(self.precision)
        )
        plugin = fabric.strategy.precision
        self.amp = isinstance(plugin, AmpPrecision)
        self.report["plugin"] = {
            "type": type(plugin).__name__,
            "backend": getattr(plugin, "backend", None),
            "precision": str(getattr(plugin, "precision", "")),
        }
        self.start("launch")
        fabric.launch()
        self.report["topology"] = {"world_size": fabric.world_size, "global_rank": fabric.global_rank}
        self.setup()
        self.collectives()
        self.autocast()
        self.gan()
        self.transformer()
        self.seq()
        self.start("log")
        self.log(100, collectives_sum=self.report["collectives"]["all_reduce_sum"])
        fabric.logger.finalize("success")
        fabric.barrier()
        self.report["logged"] = self.logged

    def setup(self) -> None:
        self.start("setup")
        fabric = self.fabric
        gan = SmallGAN()
        self.generator, self.discriminator = gan.generator, gan.discriminator
        self.transformer_model, self.seq_model = Transformer(), Seq()
        self.recorders = {
            "generator": Recorder(self.generator[0]),
            "transformer_embed": Recorder(self.transformer_model.embed),
            "seq_lstm": Recorder(self.seq_model.lstm),
        }
        models = [self.generator, self.discriminator, self.transformer_model, self.seq_model]

        def optimizers(eps: float = 1e-8) -> list[torch.optim.Optimizer]:
            return [
                torch.optim.Adam(self.generator.parameters(), lr=1e-3, eps=eps),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, eps=eps),
                torch.optim.SGD(self.transformer_model.parameters(), lr=0.05),
                torch.optim.SGD(self.seq_model.parameters(), lr=0.1, momentum=0.9),
            ]

        try:
            set_up = setup_models(fabric, models, *optimizers())
        except LightningDDPAmpError as error:
            self.report["setup_refused"] = str(error)
            set_up = setup_models(fabric, models, *optimizers(eps=1e-4))  # the fix the message names
        [self.generator, self.discriminator, self.transformer_model, self.seq_model], *opts = set_up
        self.opt_g, self.opt_d, self.opt_t, self.opt_s = opts
        self.report["model_dtypes"] = {
            name: sorted({dtype_name(p) for p in model.parameters()})
            for name, model in zip(("generator", "discriminator", "transformer", "seq"), models, strict=True)
        }
        # A second set-up in the same process: apex supports one amp.initialize, every other precision takes it.
        extra = nn.Linear(4, 2)
        try:
            extra_model, extra_optimizer = fabric.setup(extra, torch.optim.SGD(extra.parameters(), lr=0.1))
        except LightningDDPAmpError as error:
            self.report["second_setup_refused"] = str(error)
        else:
            extra_optimizer.zero_grad()
            fabric.backward(extra_model(torch.ones(2, 4)).float().sum())
            extra_optimizer.step()
            self.report["second_setup"] = {"weights_finite": weights_finite(extra_model)}

    def collectives(self) -> None:
        self.start("collectives")
        fabric = self.fabric
        rank = fabric.global_rank
        found: dict[str, Any] = {}
        value = torch.tensor(rank + 1.0)
        found["all_reduce_sum"] = float(fabric.all_reduce(value, reduce_op="sum"))
        found["all_reduce_mean"] = float(fabric.all_reduce(torch.tensor(rank + 1.0), reduce_op="mean"))
        gathered = fabric.all_gather(torch.full((2, 3), float(rank)))
        found["all_gather_shape"] = list(gathered.shape)
        found["all_gather_values"] = gathered[:, 0, 0].tolist()
        gathered_dict = fabric.all_gather({"rank": torch.tensor([rank]), "half": torch.ones(1, dtype=torch.float16)})
        found["all_gather_dict"] = {
            name: [list(tensor.shape), dtype_name(tensor), tensor.flatten().tolist()]
            for name, tensor in gathered_dict.items()
        }
        found["broadcast"] = fabric.broadcast({"from": rank, "list": [rank] * 3}, src=0)
        fabric.barrier("fabric_everyday")
        fabric.print(f"fabric.print from rank {rank}")
        self.report["collectives"] = found

    def autocast(self) -> None:
        self.start("autocast")
        a, b = torch.randn(4, 4), torch.randn(4, 4)
        outside = torch.matmul(a, b)
        with self.fabric.autocast():
            inside = torch.matmul(a, b)
        after = torch.matmul(a, b)
        self.report["autocast"] = {
            "outside": dtype_name(outside),
            "inside": dtype_name(inside),
            "after": dtype_name(after),
        }

    def backward(self, loss: torch.Tensor, loss_id: int, optimizer: Any) -> None:
        """``fabric.backward`` with ``loss_id`` and ``optimizers`` where the plugin is AmpPrecision; elsewhere the
        call with them is recorded as refused (once), then made without them."""
        if self.amp:
            self.fabric.backward(loss, loss_id=loss_id, optimizers=optimizer)
            return
        if "loss_id_refused" not in self.report:
            try:
                self.fabric.backward(loss, loss_id=loss_id, optimizers=optimizer)
            except Exception as error:
                self.report["loss_id_refused"] = f"{type(error).__name__}: {error}"
            else:
                self.report["loss_id_refused"] = None  # taken: the backward ran, and must not run twice
                return
        self.fabric.backward(loss)

    def gan(self) -> None:
        self.start("gan")
        fabric = self.fabric
        generator, discriminator, opt_g, opt_d = self.generator, self.discriminator, self.opt_g, self.opt_d
        loader = fabric.setup_dataloaders(DataLoader(images(TRAIN_SIZE, seed=1), batch_size=BATCH, shuffle=True))
        losses: list[list[float]] = []
        scales: list[Any] = []
        for step, (x, _, _) in enumerate(loader):
            real = x.flatten(1)
            noise = torch.randn(real.shape[0], 4)
            fake = generator(noise)
            ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
            loss_d = F.binary_cross_entropy_with_logits(
                discriminator(real).float(), ones
            ) + F.binary_cross_entropy_with_logits(discriminator(fake.detach()).float(), zeros)
            opt_d.zero_grad()
            self.backward(loss_d, 0, opt_d)
            opt_d.step()
            loss_g = F.binary_cross_entropy_with_logits(discriminator(fake).float(), ones)
            opt_g.zero_grad()
            self.backward(loss_g, 1, opt_g)
            opt_g.step()
            losses.append([loss_d.item(), loss_g.item()])
            scales.append(getattr(fabric.strategy.precision, "current_loss_scale", None))
            self.log(step, d_loss=loss_d.detach(), g_loss=loss_g.detach())
        self.report["gan"] = {
            "steps": len(losses),
            "losses": losses,
            "losses_finite": all(map(finite, map(torch.tensor, losses))),
            "weights_finite": weights_finite(generator, discriminator),
            "loss_scales": scales,
        }

    def evaluate(self, model: nn.Module, batches: Any) -> dict[str, Any]:
        """Eval mode under ``torch.no_grad()``: each batch's loss, the count of samples, the gathered mean loss."""
        model.eval()
        losses, samples = [], 0
        with torch.no_grad():
            for inputs, y, _ in batches:
                logits = model(inputs)
                losses.append(F.cross_entropy(logits.float(), y))
                samples += len(y)
                requires_grad = logits.requires_grad
        model.train()
        mean = torch.stack(losses).mean()
        gathered = self.fabric.all_gather(mean)
        return {
            "losses": [float(loss) for loss in losses],
            "samples": samples,
            "finite": finite(*losses),
            "requires_grad": requires_grad,
            "gathered": gathered.tolist(),
            "was_training_after": model.training,
        }

    def train(self, name: str, model: nn.Module, optimizer: Any, data: Any) -> dict[str, Any]:
        fabric = self.fabric
        train = fabric.setup_dataloaders(DataLoader(data(TRAIN_SIZE, seed=1), batch_size=BATCH, shuffle=True))
        evaluate = fabric.setup_dataloaders(DataLoader(data(EVAL_SIZE, seed=2), batch_size=BATCH))
        start = [parameter.detach().clone() for parameter in model.parameters()]
        losses = []
        for step, (inputs, y, _) in enumerate(train):
            loss = F.cross_entropy(model(inputs).float(), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item())
            self.log(step, **{f"{name}_loss": loss.detach()})
        moved = max(
            float((p.detach().float() - s.float()).abs().max()) for p, s in zip(model.parameters(), start, strict=True)
        )
        return {
            "steps": len(losses),
            "losses": losses,
            "losses_finite": finite(torch.tensor(losses)),
            "weights_finite": weights_finite(model),
            "moved": moved,
            "eval": self.evaluate(model, evaluate),
        }

    def transformer(self) -> None:
        self.start("transformer")
        self.report["transformer"] = self.train("transformer", self.transformer_model, self.opt_t, images)

    def seq(self) -> None:
        self.start("seq")
        try:
            self.report["seq"] = self.train("seq", self.seq_model, self.opt_s, sequences)
        except Exception as error:  # torch's own refusal on this CPU, or not: the test judges
            self.report["seq_failed"] = {"message": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        self.report["dtypes"] = {name: recorder.report() for name, recorder in self.recorders.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--precision", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    report: dict[str, Any] = {"precision": args.precision, "rank": int(os.environ["RANK"])}
    run = Run(args.precision, out, report)
    try:
        run.main()
    except Exception as error:
        report["error"] = {
            "part": run.part,
            "message": f"{type(error).__name__}: {error}",
            "trace": traceback.format_exc(),
        }
        raise
    finally:
        (out / f"rank{report['rank']}.json").write_text(json.dumps(report, default=str, indent=1))


if __name__ == "__main__":
    main()
