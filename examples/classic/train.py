"""The classic script examples/two_models_one_optimizer.py replaces: DDP, a DistributedSampler and NVIDIA apex amp,
by hand, with two sub-models sharing one optimizer (README, "Migrating a classic script").

    torchrun --nproc-per-node=8 examples/classic/train.py    # needs GPUs and NVIDIA apex: NCCL, apex amp O1
    PYTHONPATH=tests/doubles torchrun --nproc-per-node=2 examples/classic/train.py    # on the CPU: apex's test double

It needs NVIDIA apex (releases up to 25.05, built with CUDA); on a CPU machine this repository's CPU test double of
apex (tests/doubles) stands in, on gloo, as in the tests that check the migrated scripts end in its weights. After
each epoch rank 0 saves runs/classic/checkpoint.pt with the epochs done under "epoch" (epoch + 1, as apex's ImageNet
example saves it): --resume continues it here, convert_apex_checkpoint under the Trainer (docs/resume.md).
"""

import argparse
import contextlib
import gc
import os

import torch
import torch.distributed as dist
from apex import amp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


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
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", default="runs/classic/checkpoint.pt")
    parser.add_argument("--resume", default="", help="a checkpoint this script saved")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    parser.add_argument("--clip", type=float, default=0.0, help="max gradient norm; 0: no clipping")
    parser.add_argument("--bad-batch", type=int, default=-1, help="the batch (counted over epochs) fed an inf")
    args = parser.parse_args()

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", init_method="env://")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method="env://")

    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    y = (x[:, :10].argmax(dim=1) + (x[:, 10] > 0).long()) % 10
    dataset = TensorDataset(x, y)
    # As apex's ImageNet example does: a DistributedSampler only where several ranks share the data.
    sampler = DistributedSampler(dataset, shuffle=True) if dist.get_world_size() > 1 else None
    loader = DataLoader(dataset, batch_size=32, shuffle=sampler is None, sampler=sampler)

    model_a, model_b = Encoder().to(device), Head().to(device)
    optimizer = torch.optim.SGD(list(model_a.parameters()) + list(model_b.parameters()), lr=args.lr)
    [model_a, model_b], optimizer = amp.initialize([model_a, model_b], optimizer, opt_level=args.opt_level)
    device_ids = [local_rank] if device.type == "cuda" else None
    model_a, model_b = DDP(model_a, device_ids=device_ids), DDP(model_b, device_ids=device_ids)

    start = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device, weights_only=True)
        model_a.module.load_state_dict(checkpoint["model_a"])
        model_b.module.load_state_dict(checkpoint["model_b"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        start = checkpoint["epoch"]  # the epochs done

    for epoch in range(start, args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            if epoch * len(loader) + step == args.bad_batch:
                x[0, 0] = float("inf")  # apex skips the step its gradients overflow in
            syncing = (step + 1) % args.accumulate == 0
            with contextlib.ExitStack() as stack:
                for model in (model_a, model_b) if not syncing else ():
                    stack.enter_context(model.no_sync())
                loss = torch.nn.functional.cross_entropy(model_b(model_a(x)).float(), y) / args.accumulate
                with amp.scale_loss(loss, optimizer, delay_unscale=not syncing) as scaled_loss:
                    scaled_loss.backward()
            if syncing:
                if args.clip:
                    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.clip)
                optimizer.step()
                optimizer.zero_grad()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
            state = {"model_a": model_a.module.state_dict(), "model_b": model_b.module.state_dict()}
            state |= {"optimizer": optimizer.state_dict(), "amp": amp.state_dict(), "epoch": epoch + 1}
            os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
            torch.save(state, args.checkpoint)
    # Let go of everything that holds the last collectives (the DDP models, the loss's graph, the optimizer) while
    # the interpreter is still alive: a gloo worker that frees one after Python began to exit aborts the process.
    del model_a, model_b, loss, scaled_loss, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
