"""torchrun for dflash2 runs; launch/multinode_torchrun.sh and the SLURM scripts start runs with it.

    python launch/torchrun.py [torchrun options] launch/train.py --config <run.yaml> [key=value ...]

It is torchrun (torch.distributed.run, same options) with what a preemptible run needs:
- SIGUSR1 (what SLURM's `--signal` sends) is forwarded to the workers like SIGTERM and SIGINT:
  torchrun alone dies of SIGUSR1, and its workers then stop on their own (dflash2.faults);
- after forwarding a stop signal it gives the workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to
  finish the step and write the checkpoint before it kills them: 300 here (torchrun's own is 30);
- its exit code is the workers' (dflash2.errors): 75 when they stopped on a signal (run the same
  command to resume), 2 for a user error (the message is above it in the log), 1 for any other
  failure; torchrun alone exits 1 in all three cases.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# torchrun reads its defaults from the environment (PET_<OPTION>); options on the command line win
os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")

from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.run import main as torchrun  # noqa: E402

from dflash2.errors import EXIT_FAILED, EXIT_STOPPED, job_exit_code  # noqa: E402

# How the workers ended when torchrun shut them down after a forwarded signal: torchrun reports none
# of it (it re-raises the signal), and the launcher's exit code is theirs.
worker_codes: list[int | None] = []
_close = SubprocessContext._close


def _close_keeping_exit_codes(self, death_sig, timeout: int = 30) -> None:
    _close(self, death_sig, timeout)
    worker_codes[:] = [handler.proc.returncode for handler in self.subprocess_handlers.values()]


SubprocessContext._close = _close_keeping_exit_codes


def stopped_exit_code(signal_name: str) -> int:
    """After a forwarded signal: 75 when the workers stopped with a checkpoint, 0 when they had
    finished, else what their codes say (1: one failed, say while writing the checkpoint)."""
    codes = [code for code in worker_codes if code is not None]
    if not codes or len(codes) < len(worker_codes):
        print(
            f"[dflash2] launcher: {signal_name} forwarded to the workers; their exit is unknown",
            file=sys.stderr,
        )
        return EXIT_FAILED
    code = job_exit_code(codes)
    how = {EXIT_STOPPED: "they stopped with a checkpoint", 0: "they had finished"}
    print(
        f"[dflash2] launcher: {signal_name} forwarded to the workers; "
        + how.get(code, f"they failed (exit codes {codes}); see their errors above"),
        file=sys.stderr,
    )
    return code


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except ChildFailedError as failure:
        code = job_exit_code([f.exitcode for f in failure.failures.values()])
        if code == EXIT_FAILED:
            print(failure, file=sys.stderr)  # torchrun's table of the failed workers
        return code
    except SignalException as stop:
        # torchrun forwarded it and waited for the workers (TORCH_ELASTIC_SHUTDOWN_TIMEOUT at most)
        return stopped_exit_code(stop.sigval.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
