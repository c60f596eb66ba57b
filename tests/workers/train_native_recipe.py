"""The native AMP recipe, by hand: the reference AmpPrecision's native backend is compared with.

Plain torch, no Lightning: the forward and the loss inside ``torch.autocast``, backward and step through a
``torch.amp.GradScaler`` (none for bfloat16, which needs no loss scaling), one DDP per sub-model, and the LR schedule
held on a step the scaler skipped. The model, data, loss and schedule are train_amp.py's.

Run under torchrun; rank 0 saves OUT/reference.pt (written atomically: if it exists, it is complete).
"""

import argparse
import os

import torch
import torch.distributed as dist
from common import LR, SEED, evaluate_by_hand, save_complete, train_set
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--dtype", required=True, choices=["float16", "bfloat16"])
parser.add_argument("--overflow-at-step", type=int, default=-1, help="multiply the loss by inf at this step")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--cuda", action="store_true", help="NCCL on cuda:LOCAL_RANK instead of gloo on the CPU")
args = parser.parse_args()
dtype = getattr(torch, args.dtype)

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

# train_amp.py's TwoModels: the same seed, the same order of construction.
torch.manual_seed(SEED)
model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh()).to(device)
model_b = torch.nn.Linear(16, 1).to(device)
optimizer = torch.optim.SGD(list(model_a.parameters()) + list(model_b.parameters()), lr=LR)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
device_ids = [local_rank] if args.cuda else None
model_a, model_b = DDP(model_a, device_ids=device_ids), DDP(model_b, device_ids=device_ids)

dataset = train_set()
sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
loader = DataLoader(dataset, batch_size=4, sampler=sampler)

step = skipped = 0
hidden_dtypes = set()
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=dtype):
            hidden = model_a(x)
            loss = torch.nn.functional.mse_loss(model_b(hidden).float(), y)
        hidden_dtypes.add(str(hidden.dtype))
        if step == args.overflow_at_step:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            optimizer.step()
            scheduler.step()
        else:
            scale_before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            # The scaler backs off exactly when it skipped the step.
            if scaler.get_scale() < scale_before:
                skipped += 1
            else:
                scheduler.step()
        step += 1

evaluated = evaluate_by_hand(
    [model_a.module, model_b.module],
    lambda x: model_b.module(model_a.module(x)),
    device,
    lambda: torch.autocast(device.type, dtype=dtype),
)

if rank == 0:
    model = {f"model_a.{k}": v for k, v in model_a.module.state_dict().items()}
    model.update({f"model_b.{k}": v for k, v in model_b.module.state_dict().items()})
    reference = {
        "model": {k: v.float().cpu() for k, v in model.items()},
        "scaler": scaler.state_dict() if scaler is not None else {},
        "skipped": skipped,
        "param_dtype": str(next(model_a.module.parameters()).dtype),
        "hidden_dtypes": sorted(hidden_dtypes),
        "evaluated": evaluated,
    }
    path = os.path.join(args.out, "reference.pt")
    save_complete(reference, path)
dist.barrier()
dist.destroy_process_group()
