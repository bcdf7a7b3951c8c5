"""How the command-line tools end: their exit codes, and errors reported as one message, no traceback.

    0   done
    1   a failure (a bug, a crash, a collective that timed out, a checkpoint that could not be written)
    2   a user error: config, command line, paths, data, resume contract; the message names the fix
    3   `python -m dflash2.plan`: the run does not fit in the devices' memory
    75  stopped on SIGTERM, SIGINT or SIGUSR1 after writing a checkpoint: run the same command again to
        resume (75 is EX_TEMPFAIL; the SLURM scripts requeue on it)

A user mistake raises ValueError (the codebase's convention); `run_main` prints its message once
(global rank 0) without a traceback; the other ranks wait USER_ERROR_GRACE_S before they exit, so
that a launcher that ends the job at its first worker's exit does not end rank 0 before it prints.
`ReportedError` is a failure whose message already says what happened and where (a full disk, a
timed-out collective): each rank that meets one prints it. The traceback of either is shown with
`--debug` or DFLASH2_DEBUG=1.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_DOES_NOT_FIT = 3
EXIT_STOPPED = 75
DEBUG_ENV = "DFLASH2_DEBUG"
# how long a rank other than 0 waits before it exits on a user error (rank 0 prints the message)
USER_ERROR_GRACE_S = 5.0


class ReportedError(Exception):
    """A failure whose message is complete: printed without a traceback by the rank that raised it."""


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--debug", action="store_true", help=f"show the traceback of an error (or set {DEBUG_ENV}=1)"
    )


def global_rank() -> int:
    """This process's rank in the job as the launcher set it (0 for a plain `python` run)."""
    return int(os.environ.get("RANK", "0"))


def run_main(main: Callable[[Sequence[str] | None], object], argv: Sequence[str] | None = None) -> int:
    """Run a CLI's `main(argv)` and turn its outcome into an exit code: main's int result (None or any
    other value: 0), EXIT_USER_ERROR for a ValueError, EXIT_FAILED for a ReportedError."""
    args = sys.argv[1:] if argv is None else list(argv)
    debug = os.environ.get(DEBUG_ENV) == "1" or "--debug" in args
    try:
        result = main(argv)
    except ValueError as error:
        return _report(error, debug, EXIT_USER_ERROR, every_rank=False)
    except ReportedError as error:
        return _report(error, debug, EXIT_FAILED, every_rank=True)
    return result if isinstance(result, int) else 0


def exit_process(code: int) -> NoReturn:
    """End a command-line process with `code`, as Python would but without the interpreter's teardown.

    By the time a tool's main returns, everything it wrote is closed. What Python would still do is
    wait for non-daemon threads, run the exit handlers libraries registered, flush stdout and stderr
    (all three done here, in that order), and then tear down the thousands of modules torch,
    transformers and DeepSpeed load: 1.5 to 4 s of one core per process on a CPU (a one-step tiny
    run: 12.9 s -> 8-10 s), paid by every rank of every launch. os._exit skips only that teardown."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def job_exit_code(worker_codes: list[int]) -> int:
    """A launcher's exit code from its failed workers' codes (negative: ended by that signal): 75 when
    the workers stopped on a signal, 2 when they met a user error (in both cases workers still exiting
    after the first one may have been ended by the launcher), else 1."""
    for code in (EXIT_STOPPED, EXIT_USER_ERROR):
        if code in worker_codes and all(c == code or c < 0 for c in worker_codes):
            return code
    return EXIT_FAILED


def _report(error: Exception, debug: bool, code: int, every_rank: bool) -> int:
    if debug:
        traceback.print_exc()
    if every_rank or global_rank() == 0:
        sys.stdout.flush()
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        # torchrun ends every worker once one has exited: rank 0, which meets the same error, could be
        # ended before its message is out (seen: a launch refused at start-up printed nothing)
        time.sleep(USER_ERROR_GRACE_S)
    return code
