# The body shared by launch/slurm/*.sbatch (sourced; bash). `dflash2_slurm_run <config.yaml> [key=value ...]`:
#   1. validates the run config and refuses one that could not resume (train.resume must be auto:
#      a requeued job reruns this same script and must continue from the latest checkpoint in the
#      config's fixed output_dir), and works out the global batch on this job's GPUs: with
#      train.global_batch_size set, the accumulation steps follow the number of GPUs, so a job
#      submitted with a node range (--nodes=2-4) may be requeued onto another number of nodes and
#      continue the same run (the checkpoint is re-cut for the new number of ranks);
#   2. starts one torchrun agent per node (srun, one task per node; launch/multinode_torchrun.sh with
#      the environment from launch/slurm/slurm_env.sh, derived again inside each task);
#   3. on SIGUSR1 (#SBATCH --signal=B:USR1@120: two minutes before the time limit) passes it on to the
#      step (srun forwards it to every process of the step); the workers finish their optimizer step,
#      write a checkpoint and exit with 75, and the launcher too;
#   4. requeues the job with `scontrol requeue` when the step exits with 75 (stopped on a signal, from
#      SLURM or anyone else): the requeued job resumes at the step it stopped at, losing nothing. After
#      passing USR1 on it also requeues a step that ended by a signal: with several nodes, srun
#      (--kill-on-bad-exit) may kill the tasks still exiting once the first one has exited with 75.
#      #SBATCH --requeue also requeues after a node failure (back to the latest checkpoint then).

_DFLASH2_EXIT_STOPPED=75  # dflash2.errors.EXIT_STOPPED

_dflash2_on_usr1() {
  echo "[dflash2] job ${SLURM_JOB_ID} near its time limit: the run checkpoints and stops"
  _dflash2_signaled=1
  _dflash2_passed_on=1
  kill -USR1 "$_dflash2_step" 2>/dev/null || true
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

  trap _dflash2_on_usr1 USR1
  # NODE_RANK differs per node: each task derives its own environment.
  srun --kill-on-bad-exit=1 --nodes="${NNODES}" --ntasks-per-node=1 \
    bash -c 'source launch/slurm/slurm_env.sh && exec launch/multinode_torchrun.sh "$@"' dflash2 \
    --config "$config" "$@" &
  _dflash2_step=$!
  _dflash2_passed_on=
  local status
  while true; do
    _dflash2_signaled=
    status=0
    wait "$_dflash2_step" || status=$?
    [[ -z $_dflash2_signaled ]] && break  # else the trap ended the wait early: wait for the step itself
  done
  if [[ $status == "$_DFLASH2_EXIT_STOPPED" || (-n $_dflash2_passed_on && $status -gt 128) ]]; then
    echo "[dflash2] job ${SLURM_JOB_ID}: the run stopped with a checkpoint; requeueing, it resumes there"
    scontrol requeue "${SLURM_JOB_ID}" || echo "[dflash2] scontrol requeue failed; resubmit the job" >&2
    return 0
  fi
  return "$status"
}
