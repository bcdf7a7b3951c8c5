# The body shared by launch/slurm/*.sbatch (sourced; bash). `dflash2_slurm_run <config.yaml> [key=value ...]`:
#   1. validates the run config and refuses one that could not resume (train.resume must be auto:
#      a requeued job reruns this same script and must continue from the latest checkpoint in the
#      config's fixed output_dir), and works out the global batch on this job's GPUs: with
#      train.global_batch_size set, the accumulation steps follow the number of GPUs, so a job
#      submitted with a node range (--nodes=2-4) may be requeued onto another number of nodes and
#      continue the same run (the checkpoint is re-cut for the new number of ranks);
#   2. starts one torchrun agent per node (srun, one task per node; launch/multinode_torchrun.sh with
#      the environment from launch/slurm/slurm_env.sh, derived again inside each task);
#   3. on SIGUSR1 (#SBATCH --signal=B:USR1@120: two minutes before the time limit) requeues the job
#      with `scontrol requeue`; progress since the last checkpoint is lost, so keep train.save_every
#      short against the time limit. #SBATCH --requeue also requeues after a node failure.

_dflash2_on_usr1() {
  echo "[dflash2] job ${SLURM_JOB_ID} near its time limit: requeueing; the next run resumes from the latest checkpoint"
  _dflash2_requeued=1
  scontrol requeue "${SLURM_JOB_ID}" || echo "[dflash2] scontrol requeue failed; the job ends at its time limit" >&2
}

_dflash2_check_config() {
  "$1" - "${@:2}" <<'PY'
import sys

from dflash2.config import load_run_config

cfg = load_run_config(sys.argv[2], sys.argv[3:])
if cfg.train.resume != "auto":
    sys.exit(
        f"train.resume={cfg.train.resume!r}: a requeued SLURM job resumes only with train.resume=auto "
        "(and a fixed output_dir)"
    )
world_size = int(sys.argv[1])
data_parallel = cfg.data_parallel_size(world_size)
if data_parallel < 1:
    sys.exit(f"capture_ranks={cfg.capture_ranks} leaves no trainer among this job's {world_size} GPUs")
try:
    t = cfg.with_batch_layout(data_parallel).train
except ValueError as err:
    sys.exit(f"{err} (this job has {world_size} GPUs)")
print(f"[dflash2] run config {sys.argv[2]}: backend {cfg.backend}, topology {cfg.topology}, output_dir {cfg.output_dir}")
print(
    f"[dflash2] global batch {t.micro_batch_size * t.grad_accum_steps * data_parallel}: micro-batch "
    f"{t.micro_batch_size} x {t.grad_accum_steps} accumulation steps x {data_parallel} ranks"
    + ("" if t.global_batch_size else "; set train.global_batch_size to requeue onto another number of GPUs")
)
PY
}

dflash2_slurm_run() {
  local config=${1:?usage: sbatch launch/slurm/<name>.sbatch <config.yaml> [key=value ...]}
  shift
  local python=${PYTHON:-.venv/bin/python}
  export PYTHON=$python
  source launch/slurm/slurm_env.sh
  _dflash2_check_config "$python" "$WORLD_SIZE" "$config" "$@"
  echo "[dflash2] job ${SLURM_JOB_ID} (restart ${RESTART_COUNT}): ${NNODES} nodes x ${GPUS_PER_NODE} GPUs," \
    "rendezvous ${MASTER_ADDR}:${MASTER_PORT}"

  _dflash2_requeued=
  trap _dflash2_on_usr1 USR1
  # NODE_RANK differs per node: each task derives its own environment.
  srun --kill-on-bad-exit=1 --nodes="${NNODES}" --ntasks-per-node=1 \
    bash -c 'source launch/slurm/slurm_env.sh && exec launch/multinode_torchrun.sh "$@"' dflash2 \
    --config "$config" "$@" &
  local step=$!
  local status=0
  wait "$step" || status=$?  # a trapped signal ends the wait early (status > 128)
  if [[ -n $_dflash2_requeued ]]; then
    kill -TERM "$step" 2>/dev/null || true
    wait "$step" || true
    return 0
  fi
  return "$status"
}
