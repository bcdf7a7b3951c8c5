"""How the command-line tools end: their exit codes, and errors reported as one message, no traceback.

    0   done
    1   a failure (a bug, a crash, a collective that timed out, a checkpoint that could not be written)
    2   a user error: config, command line, paths, data, resume contract; the message names the fix
    3   `python -m dflash2.plan`: the run does not fit in the devices' memory
    75  stopped on SIGTERM, SIGINT or SIGUSR1 after writing a checkpoint: run the same command again to
        resume (75 is EX_TEMPFAIL; the SLURM scripts requeue on it)

A user mistake raises ValueError (the codebase's convention); `run_main` prints its message once,
without a traceback: rank 0 prints it; another rank waits up to USER_ERROR_GRACE_S for rank 0 to
say (in the job's rendezvous store) that it printed one, so that a launcher that ends the job at
its first worker's exit does not end rank 0 before it prints, and prints its own when rank 0 did
not (a path missing on one node only: rank 0 is then waiting in a collective). The first such rank
prints it, the others stay quiet, and a rank whose collective then breaks exits with code 2 too,
without a traceback. Before the job's process group exists there is no store: every
rank meets the same start-up error, rank 0 prints it, and the others wait and stay quiet.
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
# how long a rank other than 0 waits for rank 0 to print a user error before it prints its own
USER_ERROR_GRACE_S = 5.0
# keys in the job's rendezvous store: rank 0 printed a user error; ranks that offered to print one
USER_ERROR_PRINTED_KEY = "dflash2/user_error/printed_by_rank_0"
USER_ERROR_CLAIMS_KEY = "dflash2/user_error/claims"


COMMANDS = """dflash2's commands (run from the repository root; README.md and docs/ say more):
  python launch/train.py --config <run.yaml> [key=value ...]   train a draft (under torchrun or
                                                               deepspeed too: the same script)
  python -m dflash2.evaluate --draft <export> --target <dir> --data <prompts.jsonl>
                                                               tau and speedup against the target
  python -m dflash2.export <checkpoint> <out>                  a training checkpoint as a served model
  python -m dflash2.draft_config --target <dir> --arch <name> --out <draft.json>
                                                               a draft config made from a target
  python -m dflash2.plan <run.yaml> --world-size <N>           memory per GPU before a launch
  python -m dflash2.serving_gate --config <run.yaml> --data <train.jsonl>
                                                               train and serve one sample exactly
  python data_prep/prepare.py | regenerate.py | capture.py ... the data: tokenised, regenerated, features
"""


def not_a_command(module: str) -> NoReturn:
    """`python -m <module>` of a module that is not a command (the training loop): the commands, exit 2."""
    print(f"error: {module} is not a command; the commands are:\n{COMMANDS}", file=sys.stderr, end="")
    sys.exit(EXIT_USER_ERROR)


class ReportedError(Exception):
    """A failure whose message is complete: printed without a traceback by the rank that raised it."""


class OverridesParser(argparse.ArgumentParser):
    """The parser of a tool that takes a run config's `key=value` overrides: its usage errors also say
    how overrides are written, where the arguments show the usual slips (`--train.max_steps=5`, the
    config without `--config`)."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_known_intermixed_args(self, args=None, namespace=None):
        # its own entry point since Python 3.12.8 / 3.13.1 (no longer through parse_known_args)
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_intermixed_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        given = getattr(self, "_given", [])
        dashed = [arg for arg in given if arg.startswith("--") and "=" in arg and "." in arg.split("=")[0]]
        if dashed and "unrecognized arguments" in message:
            message += f" (overrides take no dashes: {dashed[0].lstrip('-')})"
        configs = [arg for arg in given if arg.endswith((".yaml", ".yml")) and "=" not in arg]
        if configs and "--config" in message and "--config" not in given:
            message += f" (give the run config as --config {configs[0]})"
        super().error(message)


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
    except Exception as error:
        if _another_rank_reported_a_user_error():  # a collective that broke when that rank exited
            if debug:
                traceback.print_exc()
            return EXIT_USER_ERROR  # its message says why
        if isinstance(error, ReportedError):
            return _report(error, debug, EXIT_FAILED, every_rank=True)
        raise
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
    after the first one may have been ended by the launcher), 0 when every worker finished, else 1."""
    if all(code == 0 for code in worker_codes):
        return 0
    for code in (EXIT_STOPPED, EXIT_USER_ERROR):
        if code in worker_codes and all(c == code or c < 0 for c in worker_codes):
            return code
    return EXIT_FAILED


def _report(error: Exception, debug: bool, code: int, every_rank: bool) -> int:
    if debug:
        traceback.print_exc()
    rank = global_rank()
    if every_rank or rank == 0:
        sys.stdout.flush()
        print(f"error: {error}", file=sys.stderr, flush=True)
        if not every_rank:
            _tell_other_ranks()
    elif _prints_in_place_of_rank_0():
        sys.stdout.flush()
        print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
    return code


def _job_store():
    """The job's rendezvous store once its process group exists, else None (torch not imported here
    unless the tool already did)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()  # no public getter (dflash2.run does the same)


def _tell_other_ranks() -> None:
    store = _job_store()
    if store is not None:
        try:
            store.set(USER_ERROR_PRINTED_KEY, "1")
        except Exception:  # a store already gone: the other ranks then print their own
            pass


def _another_rank_reported_a_user_error() -> bool:
    store = _job_store()
    try:
        return store is not None and store.check([USER_ERROR_CLAIMS_KEY])
    except Exception:
        return False


def _prints_in_place_of_rank_0() -> bool:
    """On a rank other than 0 that met a user error: wait up to USER_ERROR_GRACE_S for rank 0 to print
    one (torchrun ends every worker once one has exited: rank 0 could be ended before its message is
    out). True when it did not and this rank is the first to offer to print in its place."""
    store = _job_store()
    deadline = time.monotonic() + USER_ERROR_GRACE_S
    if store is None:  # no process group yet: a start-up error, which rank 0 meets too
        time.sleep(USER_ERROR_GRACE_S)
        return False
    try:
        while time.monotonic() < deadline:
            if store.check([USER_ERROR_PRINTED_KEY]):
                return False
            time.sleep(0.1)
        return store.add(USER_ERROR_CLAIMS_KEY, 1) == 1
    except Exception:  # the store is gone (its host exited): say it rather than risk saying nothing
        return True
