# Derive the multi-node launch environment from SLURM's. Source it (bash):
#
#     source launch/slurm/slurm_env.sh
#
# Exports, for torchrun / the deepspeed launcher on this node:
#   MASTER_ADDR    the address of the first host of SLURM_JOB_NODELIST (`scontrol show hostnames`):
#                  its NodeAddr as `scontrol show node` reports it, else its name
#   MASTER_PORT    DFLASH2_MASTER_PORT when set: the batch shell (launch/slurm/launch.sh) picks a port
#                  free on the first node at each start and passes it to every node, so jobs sharing
#                  a node never collide; else 20000 + SLURM_JOB_ID % 10000 (the same on every node)
#   NNODES         SLURM_NNODES (or SLURM_JOB_NUM_NODES)
#   NODE_RANK      SLURM_NODEID (or SLURM_PROCID) of this node: run one task per node
#   GPUS_PER_NODE  the allocation's: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE ("h100:8" -> 8); an
#                  exported GPUS_PER_NODE counts only when SLURM reports neither (e.g. a --gres site)
#   WORLD_SIZE     NNODES x GPUS_PER_NODE
#   RESTART_COUNT  SLURM_RESTART_COUNT (0 on the first run, +1 per requeue)
# A missing variable is an error that names it; nothing is guessed.

_slurm_env_fail() {
  echo "slurm_env.sh: $*" >&2
  return 1
}

_slurm_env_derive() {
  local job_id=${SLURM_JOB_ID:-}
  local nodelist=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
  local nnodes=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}
  local node_rank=${SLURM_NODEID:-${SLURM_PROCID:-}}
  local gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-${GPUS_PER_NODE:-}}}

  [[ -n $job_id ]] || _slurm_env_fail "SLURM_JOB_ID is unset: run inside a SLURM job (sbatch/srun)" || return 1
  [[ -n $nodelist ]] || _slurm_env_fail "SLURM_JOB_NODELIST is unset" || return 1
  [[ -n $nnodes ]] || _slurm_env_fail "SLURM_NNODES is unset" || return 1
  [[ -n $node_rank ]] || _slurm_env_fail "SLURM_NODEID/SLURM_PROCID are unset" || return 1
  gpus=${gpus##*:}  # SLURM_GPUS_PER_NODE may carry a type: "h100:8"
  if [[ -n ${GPUS_PER_NODE:-} && ${GPUS_PER_NODE} != "$gpus" ]]; then
    echo "slurm_env.sh: GPUS_PER_NODE=${GPUS_PER_NODE} ignored: the allocation has ${gpus} GPUs per node" >&2
  fi
  [[ $gpus =~ ^[0-9]+$ && $gpus -ge 1 ]] ||
    _slurm_env_fail "GPUs per node unknown ('${gpus}'): request --gpus-per-node=N or export GPUS_PER_NODE=N" ||
    return 1
  [[ $job_id =~ ^[0-9]+$ ]] || _slurm_env_fail "SLURM_JOB_ID='${job_id}' is not a number" || return 1

  local master address
  # No `| head -n 1`: under `set -o pipefail` (the sbatch files) scontrol killed by SIGPIPE after
  # head has read its line would fail the job at random.
  master=$(scontrol show hostnames "$nodelist") || return 1
  master=${master%%$'\n'*}
  [[ -n $master ]] || _slurm_env_fail "scontrol show hostnames '${nodelist}' printed no host" || return 1
  address=$(scontrol show node "$master" 2>/dev/null) || true
  [[ $address =~ NodeAddr=([^[:space:]]+) ]] && address=${BASH_REMATCH[1]} || address=
  local port=${DFLASH2_MASTER_PORT:-$((20000 + job_id % 10000))}
  [[ $port =~ ^[0-9]+$ ]] || _slurm_env_fail "DFLASH2_MASTER_PORT='${port}' is not a port number" || return 1

  export MASTER_ADDR=${address:-$master}
  export MASTER_PORT=$port
  export NNODES=$nnodes
  export NODE_RANK=$node_rank
  export GPUS_PER_NODE=$gpus
  export WORLD_SIZE=$((nnodes * gpus))
  export RESTART_COUNT=${SLURM_RESTART_COUNT:-0}
}

_slurm_env_derive
