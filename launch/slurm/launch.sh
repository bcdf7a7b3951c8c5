# The body shared by launch/slurm/*.sbatch (sourced; bash). `dflash2_slurm_run <config.yaml> [key=value ...]`:
#   1. pre-flight, before any node starts: launch/slurm/preflight.py runs the trainer's own checks of
#      the run config and of every path it reads, refuses a config that could not resume (train.resume
#      must be auto) and a global batch this job's GPUs cannot split; a problem is one message, exit 2.
#      With train.global_batch_size set, the accumulation steps follow the number of GPUs, so a job
#      submitted with a node range (--nodes=2-4) may be requeued onto another number of nodes;
#      PYTHON (default .venv/bin/python) is resolved to an absolute path here; DFLASH2_DEVICE_GB gives
#      the pre-flight's memory plan the GiB per GPU (else this node's GPU 0);
#   2. starts one torchrun agent per node (srun, one task per node, launch/multinode_torchrun.sh with
#      the environment of launch/slurm/slurm_env.sh, derived again inside each task). srun gets
#      --cpus-per-task explicitly (since Slurm 22.05 it no longer inherits it from sbatch, and each
#      node's agent and its workers would share one core) and a rendezvous port free on the first node
#      (DFLASH2_MASTER_PORT). Each node's output goes to <output_dir>/slurm/<job id>.<restart>/node<N>.out;
#      this shell's own lines also to <output_dir>/slurm/batch-<job id>.log;
#   3. on SIGUSR1 (#SBATCH --signal=B:USR1@<lead seconds>, before the time limit) passes it on to the
#      step (srun forwards it to every process of the step); when the stop has not finished a minute
#      before the time limit (scontrol's EndTime, for a signal at most an hour before it; else 240 s
#      after the signal; DFLASH2_STOP_DEADLINE_S sets the seconds), requeues the running job, which
#      resumes from its latest complete checkpoint (a job the time limit ends is TIMEOUT, which SLURM
#      never requeues), and the launcher waits for its workers up to an hour
#      (TORCH_ELASTIC_SHUTDOWN_TIMEOUT): a longer lead gives the stop more time; on SIGTERM (`scancel --signal=TERM
#      --batch`, a site that signals the batch shell) sends SIGTERM to every process of the job's
#      steps with `scancel --signal=TERM <job>`, not through srun: srun itself ends its step at once on
#      SIGTERM (it kills the tasks), so a SIGTERM that also reaches srun (`scancel --full`, the time
#      limit itself) cannot end in a checkpoint, and the job resumes from the latest periodic one.
#      The workers finish their optimizer step, write a checkpoint, and the trainers' rank 0 then
#      writes <output_dir>/stopped.json with the step (dflash2.faults);
#   4. requeues the job with `scontrol requeue` when the run wrote that marker during this start,
#      whatever srun's exit status (with several nodes, --kill-on-bad-exit may end the tasks still
#      exiting once the first one has exited with 75): the requeued job resumes at the step it stopped
#      at, losing nothing. A failure without the marker is never requeued (a bug would requeue over and
#      over), nor a job SLURM reports CANCELLED (a plain `scancel` is final), nor a run that the time
#      limit's SIGUSR1 stopped before its first step (its start-up took longer than the time before the
#      signal: a requeued job would stop there again; the marker's `trained` is 0). #SBATCH --requeue also
#      requeues after a node failure (back to the latest periodic checkpoint then).

_DFLASH2_STOP_MARKER=stopped.json  # dflash2.faults.STOP_MARKER

_dflash2_say() {
  local line="[dflash2] job ${SLURM_JOB_ID}: $*"
  echo "$line"
  if [[ -n ${_dflash2_log:-} ]]; then echo "$line" >>"$_dflash2_log"; fi
}

_dflash2_requeue() {
  scontrol requeue "${SLURM_JOB_ID}" || _dflash2_say "scontrol requeue failed; resubmit the job" >&2
}

_dflash2_on_usr1() {
  _dflash2_say "SIGUSR1: passed on to the run, which checkpoints and stops"
  _dflash2_signaled=1 _dflash2_got_usr1=1
  if [[ -z ${_dflash2_step:-} ]]; then _dflash2_pending=1; return; fi  # srun is starting: pass it on then
  kill -USR1 "$_dflash2_step" 2>/dev/null || true
  if [[ -z ${_dflash2_deadline:-} ]]; then  # the time limit ends the step (TIMEOUT: never requeued) ...
    _dflash2_deadline=${DFLASH2_STOP_DEADLINE_S:-$(_dflash2_stop_deadline)}
    # (a TERM ends the watcher's sleep too: killed alone, the sleep would outlive it)
    (
      trap 'kill "$s" 2>/dev/null; exit 0' TERM
      sleep "$_dflash2_deadline" &
      s=$!
      wait "$s" && kill -USR2 $$
    ) </dev/null >/dev/null 2>&1 &
    _dflash2_watch=$!
  fi
}

# ... unless the job is requeued first: a stop still running this long after SIGUSR1 (a checkpoint on
# a slow file system) requeues the running job, which resumes from its latest complete checkpoint.
_dflash2_on_deadline() {
  _dflash2_signaled=1
  if [[ -z ${_dflash2_step:-} ]] || ! kill -0 "$_dflash2_step" 2>/dev/null; then return; fi
  _dflash2_say "the stop did not finish within ${_dflash2_deadline} s of SIGUSR1 (DFLASH2_STOP_DEADLINE_S):" \
    "requeueing before the time limit ends the job; it resumes from the latest complete checkpoint"
  _dflash2_requeue
}

_dflash2_on_term() {
  _dflash2_say "SIGTERM: sent to every process of the run (scancel --signal=TERM), which checkpoints and stops"
  _dflash2_signaled=1
  if [[ -z ${_dflash2_step:-} ]]; then _dflash2_pending=1; return; fi  # before srun: a stop at its start
  scancel --signal=TERM "${SLURM_JOB_ID}" || kill -USR1 "${_dflash2_step:-}" 2>/dev/null || true
}

# Seconds from now to the job's time limit (scontrol's EndTime); nothing when SLURM does not say.
_dflash2_time_left() {
  local job end
  # (a site's SLURM_TIME_FORMAT may print times otherwise)
  job="$(SLURM_TIME_FORMAT=standard scontrol show job "$SLURM_JOB_ID" 2>/dev/null)" || return 0
  [[ $job =~ EndTime=([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]{8}) ]] || return 0
  end=$(date -d "${BASH_REMATCH[1]}" +%s 2>/dev/null) || return 0
  echo $((end - $(date +%s)))
}

# How long a stop may run after SIGUSR1: when the signal is the time limit's (an hour or less before
# it), up to a minute before the time limit (a requeue takes a few seconds, and the time limit's
# TIMEOUT is never requeued), so a longer --signal lead gives the stop more time, or half the time
# left under two minutes; else (a USR1 sent by hand, or SLURM does not say) 240 s, the sbatch files'
# lead of 300 less a minute.
_dflash2_max_lead_s=3600
_dflash2_stop_deadline() {
  local left
  left=$(_dflash2_time_left)
  if [[ -z $left ]] || ((left > _dflash2_max_lead_s)); then
    echo 240
  elif ((left > 120)); then
    echo $((left - 60))
  else
    echo $((left > 1 ? left / 2 : 1))
  fi
}

_dflash2_free_port() {
  "$1" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

_dflash2_cancelled() {
  # the whole output, then a match: `scontrol ... | grep -q` under pipefail fails when grep exits at
  # the first match before scontrol has written the rest (SIGPIPE), and a cancelled job was requeued
  local job
  job="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null)"
  [[ "$job" == *"JobState=CANCELLED"* ]]
}

# Wait for the step, through the traps' interruptions of `wait`; its exit status.
_dflash2_wait_step() {
  local status
  while true; do
    _dflash2_signaled=
    status=0
    wait "$_dflash2_step" || status=$?
    [[ -z $_dflash2_signaled ]] && return "$status"
  done
}

dflash2_slurm_run() {
  local config=${1:?usage: sbatch launch/slurm/<name>.sbatch <config.yaml> [key=value ...]}
  shift
  local python arg
  # the interpreter as an absolute path, the same on every node: a bare name (python3) is looked up
  # here, where the nodes' launcher would not find it
  python=$(command -v "${PYTHON:-.venv/bin/python}") || {
    _dflash2_say "error: no python at ${PYTHON:-.venv/bin/python}: set PYTHON to the environment's interpreter" >&2
    return 2
  }
  [[ $python == /* ]] || python=$PWD/$python
  export PYTHON=$python
  for arg in "$@"; do
    if [[ $arg == --device-gb* ]]; then
      _dflash2_say "error: the arguments go to launch/train.py too, which has no --device-gb: set" \
        "DFLASH2_DEVICE_GB=<GiB> in the job's environment for the pre-flight's memory plan" >&2
      return 2
    fi
  done
  # Collectives wait 1800 s until a rank's first step (one rank may read a large target from a shared
  # file system while the others wait: a 27B target is 54 GB) and 600 s from then on, unless the job
  # sets DFLASH2_STARTUP_TIMEOUT_S or DFLASH2_DIST_TIMEOUT_S (dflash2.faults); the pre-flight says which.
  # the traps first: a signal during the pre-flight (the heavy imports) is passed on once srun starts
  _dflash2_step= _dflash2_pending= _dflash2_got_usr1= _dflash2_deadline= _dflash2_watch=
  trap _dflash2_on_usr1 USR1
  trap _dflash2_on_term TERM
  trap _dflash2_on_deadline USR2
  source launch/slurm/slurm_env.sh
  local run_dir
  run_dir=$("$python" launch/slurm/preflight.py --world-size "$WORLD_SIZE" \
    ${DFLASH2_DEVICE_GB:+--device-gb "$DFLASH2_DEVICE_GB"} "$config" "$@") || return
  # the launcher's wait for its workers after a stop signal (launch/torchrun.py, 300 s by default): as
  # long as the longest stop deadline, so that the batch shell's deadline (_dflash2_stop_deadline) decides
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$_dflash2_max_lead_s}
  export DFLASH2_MASTER_PORT MASTER_PORT
  DFLASH2_MASTER_PORT=$(_dflash2_free_port "$python")
  MASTER_PORT=$DFLASH2_MASTER_PORT
  local log_dir="$run_dir/slurm/${SLURM_JOB_ID}.${RESTART_COUNT}" marker="$run_dir/$_DFLASH2_STOP_MARKER"
  mkdir -p "$log_dir"
  _dflash2_log="$run_dir/slurm/batch-${SLURM_JOB_ID}.log"
  rm -f "$marker"  # a marker from an earlier start must not requeue this one
  _dflash2_say "(restart ${RESTART_COUNT}) ${NNODES} nodes x ${GPUS_PER_NODE} GPUs," \
    "${SLURM_CPUS_PER_TASK:-all the} CPUs per node, rendezvous ${MASTER_ADDR}:${MASTER_PORT}," \
    "log ${log_dir}/node<N>.out"
  if [[ -n $_dflash2_pending ]]; then  # a stop signal during the pre-flight: the run is not started
    if [[ -n $_dflash2_got_usr1 ]]; then
      _dflash2_say "the time limit's SIGUSR1 came before the run started: not started, not requeued" \
        "(a requeued job would get no further). Give the job a longer --time"
      return 1
    fi
    if _dflash2_cancelled; then _dflash2_say "the job was cancelled before the run started"; return 0; fi
    _dflash2_say "SIGTERM before the run started: requeueing"
    _dflash2_requeue
    return 0
  fi
  # NODE_RANK differs per node: each task derives its own environment.
  # --export=ALL: the tasks need this shell's environment (PYTHON, the port, the timeouts) whatever
  # the job was submitted with (sbatch --export=NONE makes srun export nothing)
  srun --export=ALL --kill-on-bad-exit=1 --nodes="${NNODES}" --ntasks-per-node=1 \
    ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} --output="$log_dir/node%n.out" \
    bash -c 'source launch/slurm/slurm_env.sh && exec launch/multinode_torchrun.sh "$@"' dflash2 \
    --config "$config" "$@" &
  _dflash2_step=$!
  if [[ -n $_dflash2_pending ]]; then kill -USR1 "$_dflash2_step" 2>/dev/null || true; fi
  local status=0
  _dflash2_wait_step || status=$?
  trap - USR1 TERM USR2
  if [[ -n ${_dflash2_watch:-} ]]; then kill "$_dflash2_watch" 2>/dev/null || true; fi
  if [[ ! -f $marker && $status == 0 ]]; then
    _dflash2_say "the run finished"
    return 0
  fi
  if [[ ! -f $marker ]]; then
    _dflash2_say "the run ended with exit status ${status} and no stop marker: not requeued"
    return "$status"
  fi
  local stopped
  stopped=$(cat "$marker")
  if [[ $stopped == *'"trained": 0,'* && -n $_dflash2_got_usr1 ]]; then
    _dflash2_say "the run stopped on the time limit's SIGUSR1 before its first step (${stopped}): its start-up" \
      "took longer than the job's time before the signal; not requeued, a requeued job would stop there" \
      "again. Give the job a longer --time"
    return 1
  fi
  if _dflash2_cancelled; then
    _dflash2_say "the run stopped with a checkpoint (${stopped}); the job was cancelled: not requeued"
    return 0
  fi
  _dflash2_say "the run stopped with a checkpoint (${stopped}); requeueing, it resumes there"
  _dflash2_requeue
  return 0
}
