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

from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.run import main as torchrun  # noqa: E402

from dflash2.errors import EXIT_FAILED, EXIT_STOPPED, job_exit_code  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except ChildFailedError as failure:
        code = job_exit_code([f.exitcode for f in failure.failures.values()])
        if code == EXIT_FAILED:
            print(failure, file=sys.stderr)  # torchrun's table of the failed workers
        return code
    except SignalException as stop:
        # torchrun forwarded it and waited for the workers, which stopped with a checkpoint unless
        # they needed longer than TORCH_ELASTIC_SHUTDOWN_TIMEOUT; either way a resume continues the run
        print(
            f"[dflash2] launcher: {stop.sigval.name} forwarded to the workers; they stopped", file=sys.stderr
        )
        return EXIT_STOPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
