"""The classic hand-written recipe: torchrun, init_process_group, DistributedSampler + set_epoch, DDP.

Run under torchrun; rank 0 saves the final weights to OUT/weights.pt (atomically: if it exists, it is complete).
"""

import argparse
import os

import torch
import torch.distributed as dist
from common import LR, SEED, build_net, save_complete, train_set
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--batch-size", type=int, required=True, help="per-rank batch size")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--cuda", action="store_true", help="NCCL on cuda:LOCAL_RANK instead of gloo on the CPU")
args = parser.parse_args()

rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
if args.cuda:
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    model = DDP(build_net().to(device), device_ids=[local_rank], output_device=local_rank)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
    model = DDP(build_net())
dist.barrier()

optimizer = torch.optim.SGD(model.parameters(), lr=LR)
dataset = train_set()
sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()

if rank == 0:
    # Written atomically: tests accept a reference by the file alone, even when torch's teardown aborts afterwards.
    path = os.path.join(args.out, "weights.pt")
    save_complete({k: v.cpu() for k, v in model.module.state_dict().items()}, path)
dist.barrier()
dist.destroy_process_group()
