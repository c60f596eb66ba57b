#!/usr/bin/env bash
# Multi-node training with envddp: the same script on every node, one launcher command per node.
#
# torchrun, on every node (NODE_RANK=0 on the node MASTER_ADDR names; 8 GPUs per node here):
#   MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 examples/multinode.sh
#   MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NNODES=2 NODE_RANK=1 NPROC_PER_NODE=8 examples/multinode.sh
# which runs, on each node:
#   torchrun --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=8 --master-addr=10.0.0.1 --master-port=29500 \
#       examples/train_mlp.py
# Elastic rendezvous instead (nodes may start in any order; add --max-restarts=3 with auto_resume=True):
#   torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 --rdzv-id=job42 \
#       examples/train_mlp.py
# SLURM, inside the batch script: one task per GPU, envddp reads SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, ...
#   srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 python examples/train_mlp.py
# Open MPI: mpirun exports no rendezvous address, so pass rank 0's host to every rank:
#   mpirun -np 16 --map-by ppr:8:node -x MASTER_ADDR=node0 -x MASTER_PORT=29500 python examples/train_mlp.py
#
# Try it on one machine: `examples/multinode.sh --local` starts two "nodes" of two CPU ranks each on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
SCRIPT=examples/train_mlp.py

if [[ "${1:-}" == "--local" ]]; then
    port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    pids=()
    for node in 0 1; do
        "$PYTHON" -m torch.distributed.run --nnodes=2 --node-rank=$node --nproc-per-node=2 \
            --master-addr=127.0.0.1 --master-port="$port" "$SCRIPT" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid"
    done
    exit 0
fi

exec "$PYTHON" -m torch.distributed.run \
    --nnodes="${NNODES:?set NNODES to the number of nodes}" \
    --node-rank="${NODE_RANK:?set NODE_RANK: 0 on the node MASTER_ADDR names, then 1, 2, ...}" \
    --nproc-per-node="${NPROC_PER_NODE:?set NPROC_PER_NODE to the GPUs per node}" \
    --master-addr="${MASTER_ADDR:?set MASTER_ADDR to the host of node 0}" \
    --master-port="${MASTER_PORT:-29500}" \
    "$SCRIPT" "$@"
