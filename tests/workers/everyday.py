"""Everyday Lightning under one precision, on 2 ranks: what users put around the training loop (test_everyday.py).

Four LightningModules, as Lightning's own docs write them:

- ``SmallCNN`` (conv, BatchNorm, dropout, a torchmetrics metric) is fitted with validation every 3 training batches
  (the last batch of an epoch is short), ``sync_dist`` logging of float and integer tensors and Python floats with
  ``reduce_fx`` mean, sum and max, ``log_dict``, a metric object, ``ModelCheckpoint(monitor=..., save_top_k=2,
  save_last=True)``, ``EarlyStopping``, ``LearningRateMonitor`` into a ``CSVLogger``, a per-step warm-up beside
  ``ReduceLROnPlateau`` on the validation loss, gradient clipping by norm and ``accumulate_grad_batches``,
  ``self.all_gather``, ``trainer.strategy.barrier()``; then ``validate``, ``test`` and ``predict`` after the fit.
- ``SmallTransformer`` (``nn.TransformerEncoderLayer``, LayerNorm, GELU) is validated and tested in eval mode by the
  same Trainer, after the fit.
- ``SmallGAN`` (manual optimization, two Adam optimizers, ``manual_backward`` with ``loss_id``, the discriminator
  used twice a step, gradient clipping by value) is fitted by a Trainer of its own: in this process, or, where apex
  trained the CNN here (apex supports one ``amp.initialize`` per process), with ``--part gan`` in another launch; the
  first then records envddp's refusal of a second fit.
- ``SmallSeq`` (``nn.Embedding`` -> ``nn.Linear`` -> a 2-layer bidirectional ``nn.LSTM`` -> an ``nn.GRU`` started
  from the LSTM's last state -> a head) is fitted by a Trainer of its own, after the GAN or, where apex trained the
  CNN here, with ``--part seq`` in another launch; then ``validate``, ``test`` and ``predict`` after the fit, and
  its checkpoint is saved. Where its fit fails, the failure is recorded as ``seq_failed`` and the rest of the run
  stands: torch's oneDNN has no LSTM for some dtypes under CPU autocast.

``--precision``: a Trainer precision value (``32-true``, ``16-mixed``, ``bf16-mixed``, ``amp-O1``, ``apex-O2``...) or
``native-O1`` / ``native-O2`` for ``AmpPrecision(backend="native")``. ``--part``: ``all`` (default), ``cnn`` (the
CNN and the transformer), ``gan`` or ``seq``. Each rank writes OUT/cnn-rank<RANK>.json (OUT/<part>-rank<RANK>.json
for ``--part gan`` and ``--part seq``); an error is recorded there with the part that raised it, and the rank then
fails. A refusal before the GAN's first step is recorded as ``gan_refused``. ``--reload RUN...`` (one rank, a new
process) loads each run's best checkpoint, and its sequence model's where one was saved, with
``load_from_checkpoint`` and predicts under its precision into OUT/reload.json.
"""

import argparse
import json
import os
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_amp import AmpPrecision, EnvDDPStrategy, PrecisionConfigurationError

CLASSES = 4
TRAIN_SIZE = 52  # 26 samples a rank: 7 batches of 4, the last of 2
EVAL_SIZE = 37  # not a multiple of 2: DistributedSampler pads the shards
WARMUP_STEPS = 4
VOCABULARY = 8
SEQUENCE_LENGTH = 12
SEQ_CHECKPOINT = "seq.ckpt"


def images(size: int, seed: int) -> TensorDataset:
    """1x8x8 images whose class is the brightest quadrant; (image, class, index)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 1, 8, 8, generator=generator)
    quadrants = torch.stack([x[:, 0, :4, :4], x[:, 0, :4, 4:], x[:, 0, 4:, :4], x[:, 0, 4:, 4:]], dim=1)
    return TensorDataset(x, quadrants.sum(dim=(2, 3)).argmax(dim=1), torch.arange(size))


def sequences(size: int, seed: int) -> TensorDataset:
    """Token sequences whose class is the most frequent of the tokens 0 to 3 (the lowest, on a tie);
    (tokens, class, index)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCABULARY, (size, SEQUENCE_LENGTH), generator=generator)
    counts = F.one_hot(tokens, VOCABULARY)[:, :, :CLASSES].sum(dim=1)
    return TensorDataset(tokens, counts.argmax(dim=1), torch.arange(size))


def loader(size: int, seed: int, shuffle: bool = False, batch_size: int = 4, data: Any = images) -> DataLoader:
    return DataLoader(data(size, seed), batch_size=batch_size, shuffle=shuffle)


def precision_options(precision: str, num_losses: int = 1) -> dict[str, Any]:
    """The Trainer's precision, as a value or as an AmpPrecision plugin (``num_losses`` losses of their own)."""
    family, _, level = precision.partition("-")
    if family == "native" or (family in ("apex", "amp") and num_losses > 1):
        backend = {"native": "native", "apex": "apex", "amp": "auto"}[family]
        return {"plugins": [AmpPrecision(opt_level=level, backend=backend, num_losses=num_losses)]}
    return {"precision": precision}


def runs_apex(trainer: L.Trainer) -> bool:
    plugin = trainer.precision_plugin
    return isinstance(plugin, AmpPrecision) and plugin.backend == "apex"


def finite(values: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in values.items()}


class SmallCNN(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.1)
        )
        self.head = nn.Linear(8 * 4 * 4, CLASSES)
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.gathered: list[Any] = []
        self.computed_in: set[str] = set()  # the conv's output dtype, in training
        self.features[0].register_forward_hook(lambda module, args, output: self.record_dtype(output))
        self.epochs: list[dict[str, float]] = []
        self.val_losses: list[
            float
        ] = []  # each validation's during fit  # per epoch: the monitored val_loss, the LR around the plateau step

    def record_dtype(self, output: torch.Tensor) -> None:
        if self.training:
            self.computed_in.add(str(output.dtype).removeprefix("torch."))

    def lr(self) -> float:
        return float(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_epoch_end(self) -> None:
        # Lightning steps ReduceLROnPlateau after this hook, on the val_loss it monitors.
        self.epochs.append({"val_loss": float(self.trainer.callback_metrics["val_loss"]), "lr_before": self.lr()})

    def on_train_epoch_start(self) -> None:
        if self.epochs:
            self.epochs[-1]["lr_after"] = self.lr()

    def on_train_end(self) -> None:
        self.on_train_epoch_start()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1)).float()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        self.log_dict({"lr": self.optimizers().param_groups[0]["lr"], "batch": float(batch_idx)}, sync_dist=True)
        return loss

    def evaluate(self, stage: str, batch: Any) -> None:
        x, y, _ = batch
        logits = self(x)
        metric = self.val_acc if stage == "val" else self.test_acc
        metric(logits, y)
        self.log(f"{stage}_loss", F.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log(f"{stage}_acc", metric)
        # Each rank logs its own rank (Lightning makes the integers floats): with exact_eval's shards of 19 and 18 the
        # epoch mean weighs them by sample counts; the sum of rank + 1 is 3 a step, the max is 1.
        self.log(f"{stage}_rank_mean", torch.tensor(self.global_rank), sync_dist=True, reduce_fx="mean")
        self.log(f"{stage}_rank_sum", torch.tensor(self.global_rank + 1), sync_dist=True, reduce_fx="sum")
        self.log(f"{stage}_rank_max", float(self.global_rank), sync_dist=True, reduce_fx="max")
        self.log(f"{stage}_float_mean", torch.tensor(self.global_rank + 0.25), sync_dist=True, reduce_fx="mean")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate("test", batch)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, _, index = batch
        return {"index": index, "logits": self(x)}

    def on_validation_epoch_end(self) -> None:
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))
        self.gathered.append(self.all_gather(torch.tensor([self.global_rank], device=self.device)).flatten().tolist())
        self.trainer.strategy.barrier("everyday: validation epoch end")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        # LinearLR multiplies the LR it finds, so the plateau's halving stays.
        warmup = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1 / WARMUP_STEPS, total_iters=WARMUP_STEPS - 1
        )
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return [optimizer], [
            {"scheduler": warmup, "interval": "step"},
            {"scheduler": plateau, "monitor": "val_loss", "interval": "epoch"},
        ]


class SmallTransformer(L.LightningModule):
    """A token classifier; validated and tested in eval mode, where torch may take its encoder fast path."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Linear(8, 16)
        self.encoder = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, activation="gelu", batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, CLASSES)

    def evaluate(self, stage: str, batch: Any) -> None:
        x, y, _ = batch
        hidden = self.encoder(self.embed(x[:, 0]))  # each image row is a token
        logits = self.head(self.norm(hidden).mean(dim=1)).float()
        self.log(f"{stage}_transformer_loss", F.cross_entropy(logits, y), sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate("test", batch)


class SmallGAN(L.LightningModule):
    """A generator and a discriminator, one optimizer each, stepped by hand as Lightning's GAN example does."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(2)
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 64))
        self.discriminator = nn.Sequential(nn.Linear(64, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.steps = 0

    def configure_amp_models(self) -> list[nn.Module]:
        return [self.generator, self.discriminator]

    def backward_of(self, loss: torch.Tensor, loss_id: int, optimizer: Any) -> None:
        amp = (
            {"loss_id": loss_id, "optimizers": optimizer}
            if isinstance(self.trainer.precision_plugin, AmpPrecision)
            else {}
        )
        self.manual_backward(loss, **amp)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real = batch[0].flatten(1)
        noise = torch.randn(real.shape[0], 4, device=self.device)
        fake = self.generator(noise)
        ones, zeros = (
            torch.ones(real.shape[0], 1, device=self.device),
            torch.zeros(real.shape[0], 1, device=self.device),
        )
        d_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(real).float(), ones
        ) + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()).float(), zeros)
        opt_d.zero_grad()
        self.backward_of(d_loss, 0, opt_d)
        self.clip_gradients(opt_d, gradient_clip_val=0.5, gradient_clip_algorithm="value")
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake).float(), ones)
        opt_g.zero_grad()
        self.backward_of(g_loss, 1, opt_g)
        opt_g.step()
        self.steps += 1
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        ]


class SmallSeq(L.LightningModule):
    """A token classifier through an LSTM and a GRU, the GRU given an initial state."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCABULARY, 8)
        self.project = nn.Linear(8, 16)
        self.lstm = nn.LSTM(16, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(32, 16, batch_first=True)
        self.head = nn.Linear(16, CLASSES)
        self.lstm_computed_in: set[str] = set()  # the LSTM's output dtype, in training
        self.lstm.register_forward_hook(lambda module, args, output: self.record_dtype(output[0]))

    def record_dtype(self, output: torch.Tensor) -> None:
        if self.training:
            self.lstm_computed_in.add(str(output.dtype).removeprefix("torch."))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        sequence, (last, _) = self.lstm(self.project(self.embed(tokens)))
        # The GRU starts from the LSTM's final state: its last layer's, both directions summed.
        _, state = self.gru(sequence, last[-2:].sum(dim=0, keepdim=True))
        return self.head(state[0]).float()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, y, _ = batch
        loss = F.cross_entropy(self(tokens), y)
        self.log("seq_train_loss", loss, sync_dist=True)
        return loss

    def evaluate(self, stage: str, batch: Any) -> None:
        tokens, y, _ = batch
        logits = self(tokens)
        self.log(f"{stage}_seq_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}_seq_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate("test", batch)

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        tokens, _, index = batch
        return {"index": index, "logits": self(tokens)}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def trainer_options(**kwargs: Any) -> dict[str, Any]:
    return {"accelerator": "cpu", "enable_progress_bar": False, "enable_model_summary": False, **kwargs}


def run_cnn(precision: str, out: Path, report: dict[str, Any]) -> L.Trainer:
    L.seed_everything(0, workers=True)
    checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", save_top_k=2, save_last=True)
    early_stopping = EarlyStopping(monitor="val_loss", patience=5)
    trainer = L.Trainer(
        # exact_eval: the eval shards are 19 and 18 samples, so the ranks' sample counts differ.
        strategy=EnvDDPStrategy(exact_eval=True, timeout=60),
        max_epochs=2,
        val_check_interval=3,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        gradient_clip_algorithm="norm",
        logger=CSVLogger(out, name="csv", version=0),
        log_every_n_steps=1,
        callbacks=[checkpoints, early_stopping, LearningRateMonitor("step")],
        **trainer_options(**precision_options(precision), enable_model_summary=True),
    )
    report["trainer_precision"] = str(trainer.precision)
    report["apex"] = runs_apex(trainer)
    model = SmallCNN()
    with warnings.catch_warnings(record=True) as caught:  # the filters as the script has them: each warning once
        trainer.fit(model, loader(TRAIN_SIZE, seed=1, shuffle=True), loader(EVAL_SIZE, seed=2))
    report["fit_warnings"] = [str(warning.message) for warning in caught]
    report["fit"] = {
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "callback_metrics": finite(trainer.callback_metrics),
        "gathered": model.gathered,
        "best_model_path": checkpoints.best_model_path,
        "best_k_models": sorted(checkpoints.best_k_models),
        "last_model_path": checkpoints.last_model_path,
        "val_losses": model.val_losses,
        "best_model_score": float(checkpoints.best_model_score),
        "early_stopping_best": float(early_stopping.best_score),
        "epochs_around_plateau": model.epochs,
        "computed_in": sorted(model.computed_in),
    }
    report["reduce"] = reduced(trainer.strategy)
    eval_loader = loader(EVAL_SIZE, seed=3)
    report["validate"] = finite(trainer.validate(model, eval_loader, verbose=False)[0])
    report["test"] = finite(trainer.test(model, eval_loader, verbose=False)[0])
    report["predict"] = predictions(trainer.predict(model, eval_loader))
    report["predict_best"] = predictions(trainer.predict(model, eval_loader, ckpt_path="best"))

    transformer = SmallTransformer()
    report["transformer"] = {
        **finite(trainer.validate(transformer, eval_loader, verbose=False)[0]),
        **finite(trainer.test(transformer, eval_loader, verbose=False)[0]),
    }
    return trainer


def predictions(batches: Any) -> dict[str, list[Any]]:
    return {
        "index": torch.cat([batch["index"] for batch in batches]).tolist(),
        "logits": torch.cat([batch["logits"] for batch in batches]).tolist(),
    }


#: What each rank hands envddp's reduce (what Lightning's sync_dist does with a logged tensor), by name.
REDUCE_INPUTS = {
    "int64": lambda rank: torch.tensor([19 - rank]),  # mean 18.5: the fraction kept
    "uint8": lambda rank: torch.tensor([200], dtype=torch.uint8),  # the sum 400 is past uint8
    "bool": lambda rank: torch.tensor([rank == 0]),
    "float32": lambda rank: torch.tensor([rank + 0.25]),
    "bfloat16": lambda rank: torch.tensor([rank + 0.5], dtype=torch.bfloat16),
}


def reduced(strategy: Any) -> dict[str, Any]:
    """Each input reduced with each op, value and dtype, after the fit (under apex O1: with torch still patched)."""
    found: dict[str, Any] = {}
    for name, make in REDUCE_INPUTS.items():
        for op in ("mean", "sum", "max", "min") if name not in ("bool", "uint8") else ("mean",):
            result = strategy.reduce(make(strategy.global_rank), reduce_op=op)
            found[f"{name}-{op}"] = [float(result.float().item()), str(result.dtype).removeprefix("torch.")]
    return found


def run_gan(precision: str, report: dict[str, Any]) -> None:
    L.seed_everything(0, workers=True)
    trainer = L.Trainer(
        strategy=EnvDDPStrategy(find_unused_parameters=True),  # as Lightning's GAN example asks of DDP
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        **trainer_options(**precision_options(precision, num_losses=2)),
    )
    model = SmallGAN()
    try:
        trainer.fit(model, loader(TRAIN_SIZE, seed=1, shuffle=True))
    except PrecisionConfigurationError as error:  # refused before the first step: recorded for the test to judge
        report["gan_refused"] = str(error)
        return
    report["gan"] = {
        "steps": model.steps,
        "global_step": trainer.global_step,
        "callback_metrics": finite(trainer.callback_metrics),
        "weights_finite": all(torch.isfinite(p).all().item() for p in model.parameters()),
    }


def run_seq(precision: str, out: Path, report: dict[str, Any]) -> None:
    """The sequence model's fit, then validate, test and predict; a failed fit is recorded as ``seq_failed``."""
    L.seed_everything(0, workers=True)
    trainer = L.Trainer(
        strategy=EnvDDPStrategy(timeout=60),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        **trainer_options(**precision_options(precision)),
    )
    model = SmallSeq()
    start = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    eval_loader = loader(EVAL_SIZE, seed=3, data=sequences)
    try:
        trainer.fit(model, loader(TRAIN_SIZE, seed=1, shuffle=True, data=sequences), eval_loader)
    except Exception as error:  # torch's own refusal on this CPU, or not: the test judges
        report["seq_failed"] = {"message": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        return
    moved: dict[str, float] = {}
    for name, parameter in model.named_parameters():
        module = name.partition(".")[0]
        distance = float((parameter.detach().float() - start[name].float()).abs().max())
        moved[module] = max(moved.get(module, 0.0), distance)
    report["seq"] = {
        "global_step": trainer.global_step,
        "callback_metrics": finite(trainer.callback_metrics),
        "moved": moved,
        "lstm_computed_in": sorted(model.lstm_computed_in),
        "validate": finite(trainer.validate(model, eval_loader, verbose=False)[0]),
        "test": finite(trainer.test(model, eval_loader, verbose=False)[0]),
        "predict": predictions(trainer.predict(model, eval_loader)),
    }
    trainer.save_checkpoint(out / SEQ_CHECKPOINT)


def train(precision: str, part: str, out: Path, report: dict[str, Any]) -> None:
    """``part`` of the run under ``precision``; what happened goes into ``report`` (an error with its part)."""
    stage = "cnn"
    try:
        if part in ("all", "cnn"):
            trainer = run_cnn(precision, out, report)
            if part == "all" and runs_apex(trainer):
                # apex supports one amp.initialize per process: a second fit here must be refused, saying so.
                stage = "second_fit"
                second = L.Trainer(
                    strategy=EnvDDPStrategy(),
                    max_steps=1,
                    logger=False,
                    **trainer_options(**precision_options(precision)),
                )
                try:
                    second.fit(SmallCNN(), loader(TRAIN_SIZE, seed=1))
                except PrecisionConfigurationError as error:
                    report["second_fit_refused"] = str(error)
                return
        stage = "gan"
        if part in ("all", "gan"):
            run_gan(precision, report)
        stage = "seq"
        if part in ("all", "seq"):
            run_seq(precision, out, report)
    except Exception as error:
        report["error"] = {
            "part": stage,
            "message": f"{type(error).__name__}: {error}",
            "trace": traceback.format_exc(),
        }
        raise


def reload(runs: list[Path], out: Path) -> None:
    """In a new process, one rank: each run's best checkpoint, and its sequence model's where one was saved, through
    ``load_from_checkpoint``, then ``predict`` under the run's precision; OUT/reload.json holds the predictions of
    each, by run and model (``cnn``, ``seq``)."""
    found: dict[str, Any] = {}
    for run in runs:
        trained = json.loads((run / "cnn-rank0.json").read_text())
        precision = trained["precision"]
        trainer = L.Trainer(strategy=EnvDDPStrategy(), logger=False, **trainer_options(**precision_options(precision)))
        model = SmallCNN.load_from_checkpoint(trained["fit"]["best_model_path"])
        found[run.name] = {"cnn": predictions(trainer.predict(model, loader(EVAL_SIZE, seed=3)))}
        if (run / SEQ_CHECKPOINT).is_file():
            seq = SmallSeq.load_from_checkpoint(run / SEQ_CHECKPOINT)
            found[run.name]["seq"] = predictions(trainer.predict(seq, loader(EVAL_SIZE, seed=3, data=sequences)))
    (out / "reload.json").write_text(json.dumps(found))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--precision", help="the precision to train under")
    parser.add_argument("--part", default="all", choices=["all", "cnn", "gan", "seq"])
    parser.add_argument("--reload", nargs="*", default=None, help="the OUT folders of earlier runs to reload")
    args = parser.parse_args()
    out = Path(args.out)
    if args.reload is not None:
        reload([Path(run) for run in args.reload], out)
        return
    report: dict[str, Any] = {"precision": args.precision, "part": args.part, "rank": int(os.environ["RANK"])}
    try:
        train(args.precision, args.part, out, report)
    finally:
        # The CNN's report goes to cnn-rank<RANK>.json, the GAN's or the sequence model's (when it ran alone) to
        # gan-rank<RANK>.json or seq-rank<RANK>.json.
        name = args.part if args.part in ("gan", "seq") else "cnn"
        (out / f"{name}-rank{report['rank']}.json").write_text(json.dumps(report, default=str, indent=1))


if __name__ == "__main__":
    main()
