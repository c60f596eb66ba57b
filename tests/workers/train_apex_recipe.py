"""The classic apex recipe, by hand: the reference AmpPrecision is compared with (tests/test_apex_reference.py).

Plain torch and apex's public API, no Lightning: amp.initialize on both sub-models and the optimizer, then one DDP
per sub-model, backward inside amp.scale_loss, and the LR schedule held on a step the loss scaler skipped. The
model, data, loss and schedule are train_amp.py's, and so is the evaluation after training (rank 0's model on every
rank, the validation set sharded); under O2 every rank checks, as train_amp.py does, that apex steps
fp32 model parameters (model_a's BatchNorm), and no rank saves if one found none.

With --save-classic, rank 0 also saves, after --save-after epochs, the checkpoint apex's README recommends
({"model_a": ..., "model_b": ... (DDP's state_dicts: "module." names), "optimizer", "amp", "scheduler", "epoch",
"step"}) and trains on; --resume-classic continues such a checkpoint as a classic script does (test_migrate.py).

Run under torchrun; rank 0 saves OUT/reference.pt (written atomically: if it exists, it is complete).
"""

import argparse
import os

import torch
import torch.distributed as dist
from apex import amp
from common import LR, SEED, evaluate_by_hand, save_complete, train_set
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--opt-level", required=True, choices=["O0", "O1", "O2", "O3"])
parser.add_argument("--ddp-impl", default="torch", choices=["torch", "apex"])
parser.add_argument("--overflow-at-step", type=int, default=-1, help="multiply the loss by inf at this step")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--cuda", action="store_true", help="NCCL on cuda:LOCAL_RANK instead of gloo on the CPU")
parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
parser.add_argument("--save-classic", default=None, help="where rank 0 saves the classic checkpoint")
parser.add_argument("--save-after", type=int, default=1, help="the epochs done when --save-classic saves")
parser.add_argument("--resume-classic", default=None, help="a classic checkpoint to continue")
parser.add_argument("--seed-per-rank", action="store_true", help="each rank builds its models from SEED + RANK")
args = parser.parse_args()

rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
if args.cuda:
    # cuBLAS reads this when CUDA starts; without it deterministic algorithms refuse to run matmuls.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")

# train_amp.py's TwoModels: the same seed, the same order of construction. With --seed-per-rank the ranks start
# from different weights, as apex's ImageNet example seeds each rank with --deterministic: the DDP wrap gives them
# rank 0's, and apex O2 builds its fp32 masters at the first backward, after the wrap.
torch.manual_seed(SEED + rank if args.seed_per_rank else SEED)
model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh()).to(device)
model_b = torch.nn.Linear(16, 1).to(device)
parameters = list(model_a.parameters()) + list(model_b.parameters())
optimizer = torch.optim.Adam(parameters, lr=LR / 10) if args.optimizer == "adam" else torch.optim.SGD(parameters, lr=LR)

[model_a, model_b], optimizer = amp.initialize([model_a, model_b], optimizer, opt_level=args.opt_level)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
if args.ddp_impl == "apex":
    from apex.parallel import DistributedDataParallel as ApexDDP

    model_a, model_b = ApexDDP(model_a), ApexDDP(model_b)
else:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [local_rank] if args.cuda else None
    model_a, model_b = DDP(model_a, device_ids=device_ids), DDP(model_b, device_ids=device_ids)

dataset = train_set()
sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
loader = DataLoader(dataset, batch_size=4, sampler=sampler)


def loss_scale() -> float:
    return float(amp.state_dict()["loss_scaler0"]["loss_scale"])


step = skipped = start_epoch = 0
if args.resume_classic:
    # apex's README: after amp.initialize, the model, the optimizer and amp load their states (O2's fp32 masters are
    # built from the fp16 weights at the first backward).
    classic = torch.load(args.resume_classic, map_location=device, weights_only=False)
    model_a.load_state_dict(classic["model_a"])
    model_b.load_state_dict(classic["model_b"])
    optimizer.load_state_dict(classic["optimizer"])
    amp.load_state_dict(classic["amp"])
    scheduler.load_state_dict(classic["scheduler"])
    start_epoch, step = classic["epoch"], classic["step"]
hidden_dtypes = set()
for epoch in range(start_epoch, args.epochs):
    sampler.set_epoch(epoch)
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        hidden = model_a(x)
        hidden_dtypes.add(str(hidden.dtype))
        loss = torch.nn.functional.mse_loss(model_b(hidden).float(), y)
        if step == args.overflow_at_step:
            loss = loss * float("inf")
        scale_before = loss_scale()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        # apex keeps no public record of a skipped step; its loss scale backs off exactly when it skips one.
        if loss_scale() < scale_before:
            skipped += 1
        else:
            scheduler.step()
        step += 1
    if args.save_classic and rank == 0 and epoch + 1 == args.save_after:
        classic = {"model_a": model_a.state_dict(), "model_b": model_b.state_dict()}
        classic.update(optimizer=optimizer.state_dict(), amp=amp.state_dict(), scheduler=scheduler.state_dict())
        torch.save({**classic, "epoch": epoch + 1, "step": step}, args.save_classic)

if args.opt_level == "O2":
    # Every rank's count, so that one rank without fp32 model parameters stops rank 0 from saving.
    counts: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, sum(len(group) for group in optimizer._amp_stash.fp32_from_fp32_groups))
    if not all(counts):
        raise SystemExit(f"rank {rank}: apex O2's fp32 model parameters per rank: {counts}")

# The recipe evaluates the amp-initialized sub-models as they trained (O2/O3: fp16, their forward casting).
evaluated = evaluate_by_hand([model_a.module, model_b.module], lambda x: model_b.module(model_a.module(x)), device)

if rank == 0:
    model = {f"model_a.{k}": v for k, v in model_a.module.state_dict().items()}
    model.update({f"model_b.{k}": v for k, v in model_b.module.state_dict().items()})
    reference = {
        "model": {k: v.float().cpu() for k, v in model.items()},
        "master_params": [p.detach().cpu() for p in amp.master_params(optimizer)],
        "amp": dict(amp.state_dict()),
        "skipped": skipped,
        "param_dtype": str(next(model_a.module.parameters()).dtype),
        "hidden_dtypes": sorted(hidden_dtypes),
        "evaluated": evaluated,
    }
    path = os.path.join(args.out, "reference.pt")
    save_complete(reference, path)
dist.barrier()
dist.destroy_process_group()
