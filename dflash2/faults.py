"""What a run does when something outside it goes wrong: a stop signal, a dead launcher, a stalled peer.

Stop signals. SIGTERM, SIGINT and SIGUSR1 ask the run to stop: every rank finishes the optimizer step
it is in, the ranks agree (a flag all-reduced once per step, so that they stop at the same step
whichever of them got the signal), write a checkpoint together and exit with EXIT_STOPPED. Launchers
forward a signal that the workers may also get directly (torchrun forwards SIGTERM and SIGINT, srun and
`scancel` signal every process of a step, the deepspeed launcher sends SIGTERM on SIGINT): repeats
within REPEAT_WINDOW_S of the first are the same request. A later signal aborts at once: the process
dies of it, and the latest complete checkpoint stays as it was.

Stop marker. Having stopped with a checkpoint, the trainers' rank 0 writes <output_dir>/stopped.json
(`{"step": N, "trained": K, "checkpoint": ..., "signal": ...}`, K the steps this launch took) once
the checkpoint is complete: a SLURM batch shell decides to requeue from it, not from an exit code that
srun may rewrite (launch/slurm/launch.sh), and not after a stop that came before the first step.

Two runs on one output directory. A launched run's global rank 0 holds an exclusive lock on
<output_dir>/.run.lock (flock) while the job runs, and the file names it (host, process, SLURM job);
the SLURM pre-flight takes and releases it before the batch shell writes there. A second job on the
same directory, two array tasks sharing a config say, stops at start-up with one message naming the
holder, before it loads anything; the lock goes with the holding process, however it ends (a
requeued SLURM job waits a while for its own earlier run's lock, which a network file system may
hold past a node's death). A file system that refuses locks (Lustre mounted without `flock`) is
named in a note and the run goes on unlocked; one whose locks are node-local keeps apart only the
runs of one node.

Launcher death. torchrun starts each worker in a session of its own, so a worker outlives a launcher
killed with SIGKILL, or with SIGUSR1, which torchrun does not handle. `exit_with_launcher` has Linux
send a worker SIGTERM when its launcher dies: the workers stop as above, with a checkpoint.

Collective timeout. Every process group waits at most DFLASH2_STARTUP_TIMEOUT_S seconds (default 1800,
or DFLASH2_DIST_TIMEOUT_S where that is longer) for a collective or a point-to-point transfer until this
rank's first step is done (start-up: one rank may read a large target while the others wait), and
DFLASH2_DIST_TIMEOUT_S seconds (default 600) from then on (`enter_steps`). With gloo (CPU) the waiting call raises, and
`collective_section` turns that into a message naming the rank and what it was doing, after ending
the other workers of its launcher at once (a frozen one ignores SIGTERM, and torchrun waits 30 s
before its SIGKILL). With NCCL the watchdog thread ends the process itself and logs the rank and the
operation (WorkNCCL(OpType=...)), as long as TORCH_NCCL_ASYNC_ERROR_HANDLING is not 0 (torchrun sets
1, PyTorch's default is 3); the launcher then ends the others.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path

from dflash2.errors import ReportedError, global_rank

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
REPEAT_WINDOW_S = 2.0
TIMEOUT_ENV = "DFLASH2_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
STARTUP_TIMEOUT_ENV = "DFLASH2_STARTUP_TIMEOUT_S"
DEFAULT_STARTUP_TIMEOUT_S = 1800.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_MARKER = "stopped.json"
RUN_LOCK = ".run.lock"
# flock's errors where the file system has no locks, as opposed to one that another process holds
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# how long a requeued SLURM job waits for its earlier run's lock (an NFSv4 lease is 90 s by default)
REQUEUE_WAIT_S = 180.0


def _say(message: str) -> None:
    """Write from a signal handler: os.write, because a buffered print can be re-entered there."""
    os.write(sys.stderr.fileno(), f"[dflash2] rank {global_rank()}: {message}\n".encode())


class StopRequest:
    """The process's stop request: set by the first stop signal, agreed on by all ranks once per step."""

    def __init__(self) -> None:
        self.signal_name: str | None = None  # the first stop signal received
        self.stopped = False  # set by the loop when it ended early on a request
        self._received_at = 0.0
        self._unsaid = False  # a rank other than 0 got a signal and has not said so (at its next vote)

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name, self._received_at = name, now
            if global_rank() == 0:
                _say(self._receipt())
            else:  # said at this rank's next vote: a rank ended before it votes (its launcher
                self._unsaid = True  # signalled it after rank 0's user error) adds no line to the log
        elif now - self._received_at >= REPEAT_WINDOW_S:
            _say(f"second signal ({name}): aborting without a checkpoint")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _receipt(self) -> str:
        return (
            f"{self.describe()}: stopping after this optimizer step with a checkpoint "
            f"(a signal more than {REPEAT_WINDOW_S:.0f} s later aborts at once)"
        )

    def served(self) -> None:
        """The request was acted on: a later fit in this process does not stop on it."""
        self.signal_name, self._unsaid = None, False

    def describe(self) -> str:
        """The signal that asked this rank to stop, and whether its launcher is gone (asked when
        reported: the kernel may signal a launcher's death before the worker is reparented); with no
        signal here, the stop was another rank's request."""
        if self.signal_name is None:
            return "another rank's stop request"
        launcher_died = _launcher_pid is not None and os.getppid() != _launcher_pid
        return self.signal_name + (" (the launcher died)" if launcher_died else "")

    def agreed(self, backend, requested: bool | None = None) -> bool:
        """Whether any rank of the backend's group was asked to stop (collective: every rank calls it
        at the same point of every step). `requested`: this rank's vote (default: a signal arrived)."""
        import torch  # here: launch/train.py imports this module first thing, before anything heavy

        vote = self.signal_name is not None if requested is None else requested
        if self._unsaid:  # after the vote is read, so that a rank never votes to stop unsaid
            self._unsaid = False
            _say(self._receipt())
        flag = torch.tensor([1.0 if vote else 0.0], device=backend.device)
        return bool(backend.all_reduce_sum(flag).item() > 0)


stop_request = StopRequest()


def stop_marker(output_dir: str | Path) -> Path:
    """Where a run that stopped with a checkpoint says so: <output_dir>/stopped.json."""
    return Path(output_dir) / STOP_MARKER


def write_stop_marker(output_dir: str | Path, step: int, checkpoint: Path | None, start_step: int) -> Path:
    """Record that the run stopped on a signal with `checkpoint` at `step`, having started this launch
    at `start_step` (`trained`: the steps it took; 0 when the stop came during start-up), atomically:
    a reader sees the whole file or none. Call it once the checkpoint is complete, on one rank."""
    path = stop_marker(output_dir)
    record = {
        "step": step,
        "trained": step - start_step,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "signal": stop_request.describe(),  # this rank's signal, or (as the console says) another rank's request
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return path


_launcher_pid: int | None = None  # the parent whose death exit_with_launcher watches


def _open_lock_file(path: Path) -> int:
    """The lock file's descriptor, its directory made first; tried again when a run that made the
    directory removes it between the two (release_run_dir)."""
    for _ in range(3):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:
            continue
        except OSError as error:
            raise ValueError(
                f"cannot open {path} ({error.strerror}): give an output_dir this account can write"
            ) from None
    raise ValueError(f"cannot open {path}: its directory was removed each time it was made; start again")


def _still_linked(fd: int, path: Path) -> bool:
    """Whether the locked file is the one at `path` (not one a released run unlinked meanwhile)."""
    try:
        current = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)


def lock_run_dir(output_dir: str | Path, requeue_wait_s: float = REQUEUE_WAIT_S) -> int | None:
    """Take <output_dir>/.run.lock and write who holds it into the file. Returns the descriptor that
    holds it until closed, or None where the file system refuses locks (said in a note). Raises a
    ValueError naming the holder when another run holds it. A holder of this very SLURM job is its
    run before a requeue, whose lock a network file system may keep for a while after its node died:
    waited for, up to `requeue_wait_s`."""
    path = Path(output_dir) / RUN_LOCK
    job = os.environ.get("SLURM_JOB_ID")
    fd = _open_lock_file(path)
    waited_since = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _still_linked(fd, path):
                break
            os.close(fd)  # the file a finished run removed (release_run_dir): open the path again
            fd = _open_lock_file(path)
            continue
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                if error.errno not in NO_LOCKS:
                    raise
                print(
                    f"[dflash2] note: the file system of {path.parent} refuses locks ({error.strerror}): "
                    "another run on this output_dir would not be stopped",
                    file=sys.stderr,
                    flush=True,
                )
                return None
        holder = path.read_text(errors="replace").strip() or "a process that has not written its name yet"
        if not (job and f", SLURM job {job}," in holder):
            os.close(fd)
            raise ValueError(
                f"output_dir {output_dir} is in use by another run ({holder}): two runs on one directory "
                "would overwrite each other's checkpoints and logs. Wait for that run to end (a stopped "
                "run resumes from here), or give this one another output_dir"
            )
        if waited_since is None:
            waited_since = time.monotonic()
            print(
                f"[dflash2] output_dir {output_dir} is locked by this SLURM job's earlier run ({holder}): "
                f"waiting up to {requeue_wait_s:.0f} s for the file system to release it",
                file=sys.stderr,
                flush=True,
            )
        if time.monotonic() - waited_since >= requeue_wait_s:
            os.close(fd)
            raise ValueError(
                f"output_dir {output_dir} is still locked by this SLURM job's earlier run ({holder}) after "
                f"{requeue_wait_s:.0f} s: if its processes are gone (a dead node whose lock the file system "
                f"keeps), delete {path} and submit the job again"
            )
        time.sleep(1.0)
    holder = f"process {os.getpid()} on {socket.gethostname()}" + (f", SLURM job {job}" if job else "")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{holder}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    os.fsync(fd)  # another node reads it from the server, not from this node's page cache
    return fd


def release_run_dir(fd: int, output_dir: str | Path, created: bool) -> None:
    """Let go of lock_run_dir's lock. A directory that the lock created (`created`) and that holds
    nothing else (a run stopped by a user error before it wrote a file) is removed, lock and all, so
    the error leaves nothing behind: the lock file is unlinked while still held, so that a run
    starting meanwhile either finds it held or makes a new one."""
    path = Path(output_dir)
    try:
        if created and [child.name for child in path.iterdir()] == [RUN_LOCK]:
            (path / RUN_LOCK).unlink()
            path.rmdir()
    except OSError:
        pass  # another run's files appeared meanwhile: the directory is theirs
    finally:
        os.close(fd)


def exit_with_launcher() -> None:
    """Under a launcher (RANK in the environment this process started with: torchrun, the deepspeed
    launcher), have Linux send this process SIGTERM when the launcher dies. A plain `python` run
    keeps running if its shell goes away, also once it has set RANK itself."""
    global _launcher_pid
    if not sys.platform.startswith("linux") or _job_of(os.getpid()) is None:
        return
    _launcher_pid = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    # (a launcher that died before this call goes unnoticed; its parent id cannot tell, since a
    # launcher may itself be process 1 in a container)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _seconds(name: str, default: float, what: str) -> timedelta:
    text = os.environ.get(name, "")
    try:
        seconds = float(text) if text else default
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{name}={text!r}: give the {what} in seconds (> 0)")
    return timedelta(seconds=seconds)


def collective_timeout() -> timedelta:
    """How long a rank waits for a collective or a transfer once it has taken its first step:
    DFLASH2_DIST_TIMEOUT_S (default 600)."""
    return _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, "collective timeout")


def startup_timeout() -> timedelta:
    """How long a rank waits for a collective or a transfer before then (loading and sharding the
    target, where one rank may read a large checkpoint while the others wait): DFLASH2_STARTUP_TIMEOUT_S,
    by default 1800 or the collective timeout where that is longer."""
    default = max(DEFAULT_STARTUP_TIMEOUT_S, collective_timeout().total_seconds())
    return _seconds(STARTUP_TIMEOUT_ENV, default, "start-up collective timeout")


# this process's groups' timeout since enter_steps, and its name; None before (the start-up's)
_steps_wait: tuple[timedelta, str] | None = None


def _set_timeouts(timeout: timedelta) -> None:
    """Every process group of this process waits at most `timeout` from its next operation on."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world  # no public way, torch 2.13

    for group in list(_world.pg_map):  # the groups this rank is a member of
        _set_pg_timeout(timeout, group)


def enter_startup() -> None:
    """A run starts: every process group waits at most startup_timeout() until its first step (also
    the groups an earlier run of this process lowered, and those made without a timeout)."""
    global _steps_wait
    import torch.distributed as dist

    _steps_wait = None
    if dist.is_initialized():
        _set_timeouts(startup_timeout())


def enter_steps(steps_per_wait: int = 1) -> None:
    """Every process group of this process waits at most collective_timeout() from here on, times
    `steps_per_wait` for a rank whose one wait may span that many of its peers' operations (a capture
    rank's send: a trainer's step and a checkpoint write). Call it once this rank's first step is
    done: its peers have finished their start-up then, having taken that step with it. A no-op
    without a process group, and when called again."""
    global _steps_wait
    import torch.distributed as dist

    if _steps_wait is not None or not dist.is_initialized():
        return
    name = TIMEOUT_ENV if steps_per_wait == 1 else f"{steps_per_wait} x {TIMEOUT_ENV}"
    _steps_wait = (collective_timeout() * steps_per_wait, name)
    _set_timeouts(_steps_wait[0])


def enter_end() -> None:
    """This rank has done its part and waits for its peers to end theirs (their last steps, final
    checkpoint and export, together): the longer of the start-up timeout and the one it waits now."""
    global _steps_wait
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    _steps_wait = max(current_timeout(), (startup_timeout(), STARTUP_TIMEOUT_ENV), key=lambda wait: wait[0])
    _set_timeouts(_steps_wait[0])


def in_steps() -> bool:
    """Whether this process's groups wait the steps' timeout now (`enter_steps` was called)."""
    return _steps_wait is not None


def current_timeout() -> tuple[timedelta, str]:
    """How long this process's collectives wait now, and the setting that says so."""
    return _steps_wait if _steps_wait is not None else (startup_timeout(), STARTUP_TIMEOUT_ENV)


def is_collective_failure(error: BaseException) -> bool:
    """A collective or transfer that timed out or lost its peer (gloo raises a plain RuntimeError)."""
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or "gloo" in str(error)


@contextmanager
def collective_section(what: str) -> Iterator[None]:
    """Name this rank and `what` in the error of a collective that fails or times out inside."""
    try:
        yield
    except RuntimeError as error:
        if not is_collective_failure(error):
            raise
        detail = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        waits, setting = current_timeout()
        end_sibling_workers()
        raise ReportedError(
            f"rank {global_rank()}: {what} did not complete: {detail}. Another rank stalled or died "
            f"(collectives wait at most {waits.total_seconds():.0f} s here, {setting}); "
            "this node's other workers were ended. Resume from the latest checkpoint."
        ) from error


def end_sibling_workers() -> None:
    """SIGKILL the other workers of this job started by this process's launcher: after a collective
    failed the job cannot go on, and a frozen worker would wait for the launcher's own SIGKILL
    (torchrun: 30 s later). Only processes of the same job (same rendezvous address and world size),
    and only from a process its launcher started as a worker (RANK in the environment it started
    with): a process that set RANK itself (a plain `python` run, a test) has no siblings, and the
    other children of its parent are no workers of its job."""
    job = _job_of(os.getpid())
    if _launcher_pid is None or os.getppid() != _launcher_pid or job is None:
        return
    for pid in children_of(_launcher_pid):
        if pid != os.getpid() and _job_of(pid) == job:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def children_of(parent: int) -> list[int]:
    """Ids of the live (not zombie) children of `parent`, oldest first, from /proc (its per-task
    `children` files are optional). Ordered by start time: ids are not ordered once they wrap."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # the process ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # the fields after "(comm)": state, ppid, ...
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append((int(fields[19]), int(entry)))  # starttime, in clock ticks
    return [pid for _, pid in sorted(found)]


def process_environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with, from /proc (OSError if it is gone or not ours)."""
    pairs = Path("/proc", str(pid), "environ").read_bytes().split(b"\0")
    return dict(pair.decode(errors="replace").split("=", 1) for pair in pairs if b"=" in pair)


def _job_of(pid: int) -> tuple[str, ...] | None:
    """(MASTER_ADDR, MASTER_PORT, WORLD_SIZE) of a launched worker, None for any other process."""
    try:
        env = process_environ(pid)
    except OSError:
        return None
    if "RANK" not in env:
        return None
    return tuple(env.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"))
