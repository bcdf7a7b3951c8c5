#!/usr/bin/env bash
# Start a multi-node DeepSpeed run from one node: the deepspeed launcher reads the hostfile and
# starts every node's processes over pdsh/ssh (passwordless ssh between the nodes, the same
# checkout path and environment on each). Over ssh a process gets only the variables the launcher
# forwards: those named NCCL*, PYTHON*, UCX*, MV2*, MLFLOW*, the ones listed in ~/.deepspeed_env or
# ./.deepspeed_env, and here also this shell's DFLASH2_* and TORCH_* (DFLASH2_DIST_TIMEOUT_S, ...).
#
#   HOSTFILE=hostfile launch/multinode_deepspeed.sh --config configs/recipes/qwen3.6-27b-dflash2-8gpu-zero3.yaml [key=value ...]
#
# hostfile, one node a line:   node0 slots=8
#                               node1 slots=8
# Arguments go to launch/train.py. MASTER_ADDR defaults to the first host of the hostfile,
# MASTER_PORT to 29500; DEEPSPEED selects the launcher (default: the repository's .venv).
# Under SLURM use launch/slurm/zero3.sbatch instead (no ssh needed).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deepspeed=${DEEPSPEED:-$root/.venv/bin/deepspeed}
: "${HOSTFILE:?set HOSTFILE (lines of '<host> slots=<gpus>')}"
[[ -f $HOSTFILE ]] || { echo "multinode_deepspeed.sh: hostfile $HOSTFILE does not exist" >&2; exit 2; }
[[ -x $deepspeed ]] || { echo "multinode_deepspeed.sh: no deepspeed at $deepspeed; set DEEPSPEED" >&2; exit 2; }
master_addr=${MASTER_ADDR:-$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$HOSTFILE")}
[[ -n $master_addr ]] || { echo "multinode_deepspeed.sh: no host in $HOSTFILE" >&2; exit 2; }

# One env file for the launcher (DS_ENV_FILE) with the user's lines and this run's settings.
env_file=$(mktemp "${TMPDIR:-/tmp}/dflash2-deepspeed-env.XXXXXX")
# line by line (grep ends each with a newline: a file whose last line had none merged it into the next
# one's first) and without blank lines (DeepSpeed's runner fails on a line without '=')
for listed in ~/.deepspeed_env .deepspeed_env; do
  [[ -f $listed ]] && { grep -v '^[[:space:]]*$' "$listed" >>"$env_file" || true; }
done
env | grep -E '^(DFLASH2|TORCH)_[A-Za-z0-9_]*=' >>"$env_file" || true
export DS_ENV_FILE=$env_file

exec "$deepspeed" --hostfile "$HOSTFILE" --master_addr "$master_addr" --master_port "${MASTER_PORT:-29500}" \
  "$root/launch/train.py" "$@"
