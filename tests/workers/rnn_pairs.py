"""RNNs fed by fp16 activations under apex O1, as a classic/Lightning pair (test_apex_reference.py).

The model reads token ids through an embedding and a Linear (so O1 hands the first RNN an fp16 input), then an
``nn.LSTM`` (batch-first, 2 layers, bidirectional, no initial state), an ``nn.GRU`` (time-first, given a learned
initial state), an ``nn.RNN`` (ReLU) over a ``PackedSequence`` of the GRU's output, and a head.

--mode classic: the recipe by hand (DDP, a DistributedSampler, ``amp.initialize`` O1, ``amp.scale_loss``) with the
change a torch newer than 2.1 needs applied by hand, as its user would: each RNN's input in its weights' dtype for
torch's dtype check (apex casts it back to fp16 inside ``_VF``), and apex's own ``wrap.new_rnn_cast`` for
``nn.RNN``'s ``_VF.rnn_tanh`` / ``rnn_relu``, which today's ``nn.RNN.forward`` calls past apex's patch.
--mode lightning: the same model under ``Trainer(strategy="envddp", precision="apex-O1")``, unchanged (``--level O2``
or ``O3``: the levels that cast the whole model, where nothing is lifted).

Rank 0 saves OUT/weights.pt (the model's fp32 state_dict) and OUT/dtypes.json (the dtype of each RNN's output).
With --cuda both run on cuda:LOCAL_RANK over NCCL, where apex's RNN cast meets cuDNN's flat weights, the layout it
was written for (tests/test_cuda.py, with real apex).
"""

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from common import LR, SEED
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", required=True, choices=["classic", "lightning"])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--level", default="O1", choices=["O1", "O2", "O3"], help="--mode lightning's apex level")
parser.add_argument("--cuda", action="store_true", help="NCCL on cuda:LOCAL_RANK (cuDNN's flat RNN weights)")
args = parser.parse_args()
if args.cuda:
    # cuBLAS reads this when CUDA starts; without it deterministic algorithms refuse to run matmuls.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.cuda else torch.device("cpu")
out = Path(args.out)

TOKENS, STEPS, SIZE = 10, 6, 32


def sequences() -> TensorDataset:
    """Token sequences, their lengths (for the packed RNN) and a target: the share of tokens above the middle."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TOKENS, (SIZE, STEPS), generator=generator)
    lengths = torch.randint(2, STEPS + 1, (SIZE,), generator=generator)
    target = (tokens >= TOKENS // 2).float().mean(dim=1, keepdim=True)
    return TensorDataset(tokens, lengths, target)


class Sequence(nn.Module):
    def __init__(self, by_hand: bool = False) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.embedding = nn.Embedding(TOKENS, 8)
        self.project = nn.Linear(8, 8)
        self.lstm = nn.LSTM(8, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(16, 8)
        self.h0 = nn.Parameter(torch.zeros(1, 1, 8))
        self.rnn = nn.RNN(8, 8, nonlinearity="relu")
        self.head = nn.Linear(8, 1)
        self.by_hand = by_hand
        self.dtypes: dict[str, str] = {}

    def _input(self, rnn: nn.RNNBase, x: Any) -> Any:
        # The classic script's change for torch's RNN dtype check: what envddp does by itself.
        return x.to(rnn.weight_ih_l0.dtype) if self.by_hand else x

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.project(self.embedding(tokens))  # fp16 under O1: a Linear
        x, _ = self.lstm(self._input(self.lstm, x))
        self.dtypes["lstm"] = str(x.dtype)
        h0 = self.h0.expand(1, tokens.shape[0], 8).contiguous()
        x, _ = self.gru(self._input(self.gru, x.transpose(0, 1)), h0)
        self.dtypes["gru"] = str(x.dtype)
        packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
        x, _ = pad_packed_sequence(self.rnn(self._input(self.rnn, packed))[0])
        self.dtypes["rnn"] = str(x.dtype)
        return self.head(x.sum(dim=0) / lengths.unsqueeze(1).to(x))


def loss_of(model: nn.Module, batch: Any) -> torch.Tensor:
    tokens, lengths, target = batch
    return nn.functional.mse_loss(model(tokens, lengths).float(), target)


def save(net: Sequence) -> None:
    torch.save({name: tensor.detach().float().cpu() for name, tensor in net.state_dict().items()}, out / "weights.pt")
    (out / "dtypes.json").write_text(json.dumps(net.dtypes))


def classic() -> None:
    import torch.distributed as dist
    from apex import amp
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    from lightning_ddp_amp.launch.process_group import destroy_process_group

    dist.init_process_group("nccl" if args.cuda else "gloo")
    net = Sequence(by_hand=True).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    net, optimizer = amp.initialize(net, optimizer, opt_level="O1")
    for name in ("rnn_tanh", "rnn_relu"):  # by hand: apex's cast for nn.RNN, which today's torch calls past
        amp.wrap.new_rnn_cast(name, amp._amp_state.handle)
    model = DDP(net, device_ids=[device.index] if args.cuda else None)
    dataset = sequences()
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = [tensor.to(device) for tensor in batch]  # as Lightning moves the batch
            with amp.scale_loss(loss_of(model, batch), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    if dist.get_rank() == 0:
        save(net)
    destroy_process_group()


def lightning() -> None:
    import lightning as L

    import lightning_ddp_amp  # noqa: F401 (registers "envddp" and "apex-O1")

    class Migrated(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Sequence()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_of(self.net, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR)

    trainer = L.Trainer(
        strategy="envddp", precision=f"apex-{args.level}", accelerator="cuda" if args.cuda else "cpu", max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = Migrated()
    trainer.fit(module, DataLoader(sequences(), batch_size=4, shuffle=True))
    if trainer.is_global_zero:
        save(module.net)


classic() if args.mode == "classic" else lightning()
