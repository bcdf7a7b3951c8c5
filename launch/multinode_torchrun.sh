#!/usr/bin/env bash
# Start this node's torchrun agent of a multi-node run; run it on every node. Nodes meet at
# MASTER_ADDR:MASTER_PORT (a node every node can reach) through torchrun's static rendezvous: the
# agent of NODE_RANK 0 hosts it, and node N's processes are ranks N*GPUS_PER_NODE onwards. (The c10d
# rendezvous instead picks its host by matching MASTER_ADDR to a node's own host name, which fails
# when the address is one of a node's other interfaces, and orders the ranks by host name.)
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 GPUS_PER_NODE=8 \
#       launch/multinode_torchrun.sh --config configs/recipes/qwen3.6-27b-dflash2-8gpu-zero3.yaml [key=value ...]
#
# Arguments go to launch/train.py. The agent is launch/torchrun.py: torchrun that also forwards SIGUSR1
# to the workers, gives them time to checkpoint, and exits with their code (75: stopped on a signal).
# Run from the repository root (paths in run configs are relative to it). PYTHON selects the
# interpreter (default: the repository's .venv). Under SLURM, launch/slurm/*.sbatch set all of this.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (this node: 0 .. NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (a host every node can reach)}"
: "${MASTER_PORT:?set MASTER_PORT (a free TCP port on MASTER_ADDR)}"
: "${GPUS_PER_NODE:?set GPUS_PER_NODE (processes per node)}"
python=$(command -v "$python") || { echo "multinode_torchrun.sh: no python at $python; set PYTHON" >&2; exit 2; }

exec "$python" "$root/launch/torchrun.py" \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  "$root/launch/train.py" "$@"
