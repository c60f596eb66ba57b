"""Two sub-models and one optimizer, the classic apex recipe, under Trainer(strategy="envddp", precision=...).

model_a holds an affine BatchNorm, which apex O2 keeps in fp32 (``keep_batchnorm_fp32``). So under O2 the optimizer
steps fp32 model parameters beside the fp32 masters of the fp16 ones; apex stashes their gradients and adds them up
across ``scale_loss`` calls until ``optimizer.zero_grad()`` zeroes them. Every rank checks that apex found them (its
``fp32_from_fp32_groups``), and fails otherwise.

Each rank writes OUT/rank<RANK>.json: what the precision plugin did (the apex double's event log when apex is the
test double), the loss-scaler state right after a resume, the LR scheduler's progress; rank 0 saves the weights, and
OUT/amp_state.pt with the keys of the hand-written references (train_apex_recipe.py, train_native_recipe.py).
"""

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import LR, SEED, VAL_BATCH, gather_predictions, train_set, val_set
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ddp_amp import AmpPrecision, EnvDDPStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--precision", default="32-true", help="a Trainer precision value, or 'plugin'")
parser.add_argument("--opt-level", default="O1", help="with --precision plugin")
parser.add_argument("--dtype", default="float16", help="with --precision plugin")
parser.add_argument("--ddp-impl", default="torch")
parser.add_argument("--accelerator", default="cpu")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--overflow-at-step", type=int, default=-1, help="multiply the loss by inf at this step")
parser.add_argument("--checkpoint", action="store_true", help="save the last checkpoint to OUT/last.ckpt")
parser.add_argument("--resume", default=None, help="checkpoint to resume from")
parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
parser.add_argument("--seed-per-rank", action="store_true", help="each rank builds its models from SEED + RANK")
args = parser.parse_args()
out = Path(args.out)
if args.accelerator == "cuda":
    # As the hand-written references do on a GPU, so that a pair can be compared bit for bit.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def apex_events() -> list[dict[str, Any]]:
    try:
        from apex import amp  # the test double, when tests/doubles is on PYTHONPATH
    except ImportError:
        return []
    return amp.events


class RecordingEnvDDPStrategy(EnvDDPStrategy):
    """EnvDDPStrategy that notes, in the apex double's event log, when it wraps the model in DDP."""

    def _setup_model(self, model: torch.nn.Module) -> Any:
        apex_events().append({"event": "ddp_wrap", "model": type(model).__name__})
        return super()._setup_model(model)


class TwoModels(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED + int(os.environ["RANK"]) if args.seed_per_rank else SEED)
        self.model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh())
        self.model_b = torch.nn.Linear(16, 1)
        self.hidden_dtypes: set[str] = set()
        self.param_dtype = ""
        self.skipped = 0
        self.at_start: dict[str, Any] = {}
        self.wrapper = ""
        self.evaluated: dict[str, dict[int, torch.Tensor]] = {}

    def configure_amp_models(self) -> list[torch.nn.Module]:
        return [self.model_a, self.model_b]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        hidden = self.model_a(x)
        self.hidden_dtypes.add(str(hidden.dtype))
        loss = torch.nn.functional.mse_loss(self.model_b(hidden).float(), y)
        if self.global_step == args.overflow_at_step:
            loss = loss * float("inf")
        return loss

    def evaluation_step(self, stage: str, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, index = batch
        output = self.model_b(self.model_a(x)).float()
        self.evaluated.setdefault(stage, {}).update(zip(index.tolist(), output.detach().cpu(), strict=True))
        return output, torch.nn.functional.mse_loss(output, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.evaluation_step("validate", batch)[1], sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.evaluation_step("test", batch)[1], sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.evaluation_step("predict", batch)[0]

    def on_train_start(self) -> None:
        # Runs after Lightning restored the checkpoint (precision state included), before any step.
        self.at_start = {"precision_state": self.trainer.precision_plugin.state_dict(), "global_step": self.global_step}
        plugin = self.trainer.precision_plugin
        if self.trainer.is_global_zero and isinstance(plugin, AmpPrecision) and plugin.backend == "apex":
            from apex import amp

            optimizer = self.trainer.optimizers[0]
            masters = [p.detach().cpu().clone() for p in amp.master_params(optimizer)]
            torch.save({"master_params": masters, "optimizer": optimizer.state_dict()}, out / "at_start.pt")

    def on_train_end(self) -> None:
        self.param_dtype = str(self.model_a[0].weight.dtype)
        wrapper = type(self.trainer.model)
        self.wrapper = f"{wrapper.__module__}.{wrapper.__qualname__}"

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        plugin = self.trainer.precision_plugin
        if isinstance(plugin, AmpPrecision) and plugin.step_skipped(self.optimizers().optimizer):
            self.skipped += 1

    def configure_optimizers(self) -> Any:
        adam = args.optimizer == "adam"
        optimizer = (
            torch.optim.Adam(self.parameters(), lr=LR / 10) if adam else torch.optim.SGD(self.parameters(), lr=LR)
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


precision: Any = args.precision
plugins: list[Any] = []
if args.precision == "plugin":
    precision = None
    plugins = [AmpPrecision(opt_level=args.opt_level, backend="native", dtype=args.dtype)]
callbacks = [ModelCheckpoint(dirpath=out, filename="last", save_top_k=1)] if args.checkpoint else []
trainer = L.Trainer(
    strategy=RecordingEnvDDPStrategy(ddp_impl=args.ddp_impl),
    accelerator=args.accelerator,
    precision=precision,
    plugins=plugins,
    max_epochs=args.epochs,
    logger=False,
    callbacks=callbacks,
    enable_checkpointing=args.checkpoint,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = TwoModels()
trainer.fit(model, DataLoader(train_set(), batch_size=4, shuffle=True), ckpt_path=args.resume)

# Evaluation after fit, in this process, on the model as it trained: what the recipe's evaluation loop computes.
val_loader = DataLoader(val_set(), batch_size=VAL_BATCH)
trainer.validate(model, val_loader, verbose=False)
trainer.test(model, val_loader, verbose=False)
trainer.predict(model, val_loader, return_predictions=False)
evaluated = {stage: gather_predictions(predictions) for stage, predictions in sorted(model.evaluated.items())}

plugin = trainer.precision_plugin
if isinstance(plugin, AmpPrecision) and plugin.backend == "apex" and plugin.opt_level == "O2":
    # Without fp32 model parameters, apex O2's zero_grad would change nothing that the next backward does not reset.
    fp32_from_fp32 = trainer.optimizers[0]._amp_stash.fp32_from_fp32_groups
    if not any(fp32_from_fp32):
        raise SystemExit(f"rank {os.environ['RANK']}: apex O2 found no fp32 model parameters: {fp32_from_fp32}")

events = apex_events()
outside = None
if events:
    from apex import amp

    outside = amp.backward_outside_scale_loss()
scheduler = model.lr_schedulers()
report = {
    "precision": trainer.precision,
    "events": events,
    "backward_outside_scale_loss": outside,
    "hidden_dtypes": sorted(model.hidden_dtypes),
    "global_step": trainer.global_step,
    "scheduler_steps": scheduler.last_epoch,
    "skipped": model.skipped,
    "at_start": model.at_start,
    "precision_state": trainer.precision_plugin.state_dict(),
    "wrapper": model.wrapper,
}
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report, default=str))
if trainer.is_global_zero:
    state = {k: v.float().cpu() for k, v in model.state_dict().items()}
    torch.save(state, out / "weights.pt")
    amp_state: dict[str, Any] = {
        "model": state,
        "skipped": model.skipped,
        "param_dtype": model.param_dtype,
        "hidden_dtypes": sorted(model.hidden_dtypes),
        "evaluated": evaluated,
    }
    if isinstance(plugin, AmpPrecision) and plugin.backend == "apex":
        from apex import amp

        optimizer = trainer.optimizers[0]
        amp_state["master_params"] = [p.detach().cpu() for p in amp.master_params(optimizer)]
        amp_state["amp"] = dict(amp.state_dict())
    elif isinstance(plugin, AmpPrecision):
        amp_state["scaler"] = plugin.state_dict()["grad_scaler"]
    torch.save(amp_state, out / "amp_state.pt")
