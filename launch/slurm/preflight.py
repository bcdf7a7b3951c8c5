"""The SLURM scripts' check of a run before `srun` starts it on every node (launch/slurm/launch.sh).

    python launch/slurm/preflight.py --world-size N <config.yaml> [key=value ...]

The same checks as launch/train.py (the run config, its overrides, every path it reads, the draft config
against the target, the backend's files such as a DeepSpeed JSON, the checkpoint to resume) plus what
a requeued job needs: train.resume auto (a requeued job reruns the same command and must continue from
the latest checkpoint in the fixed output_dir), a global batch that this job's GPUs can split, at
least one trainer rank, and an output_dir no other run holds (dflash2.faults.lock_run_dir: taken and
released here, before the batch shell writes its logs there). A problem is one message and exit 2
(no traceback), before any node starts.
The run's layout and the memory planner's estimate per GPU (dflash2.plan, against this node's GPU 0,
or --device-gb) go to stderr (the job's log), with a warning where the estimate is over: a warning,
not a refusal, since the activations are estimates. stdout is one line, the run's output_dir, for
the batch shell (the run's logs and its stop marker live there).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from dflash2.checkpoint import check_resume  # noqa: E402
from dflash2.config import check_run_paths, load_run_config  # noqa: E402
from dflash2.errors import OverridesParser, add_debug_flag, exit_process, run_main  # noqa: E402
from dflash2.faults import STARTUP_TIMEOUT_ENV, TIMEOUT_ENV, collective_timeout, lock_run_dir, startup_timeout  # noqa: E402
from dflash2.plan import DEVICE_GB, GIB, check_positive, plan_run  # noqa: E402
from dflash2.run_plan import resolve_run  # noqa: E402


def device_memory(device_gb: float | None) -> tuple[float, str]:
    """The GiB a GPU has for the run, and where that number comes from."""
    if device_gb is not None:
        return device_gb, "--device-gb"
    import torch

    try:
        if torch.cuda.is_available():
            total = math.floor(torch.cuda.mem_get_info(0)[1] / GIB * 10) / 10  # as printed
            return total, f"this node's GPU 0, {torch.cuda.get_device_name(0)}"
    except Exception as error:  # a GPU busy or failing here is the run's to meet, not the pre-flight's
        return DEVICE_GB, f"GPU 0 not readable here ({type(error).__name__}: {error}): the planner's default"
    return DEVICE_GB, "no GPU visible here: the planner's default"


def memory_lines(
    config: str, overrides: list[str], cfg, target_config, world_size: int, device_gb: float | None
) -> list[str]:
    """The planner's peak estimate for each role's ranks against a GPU's memory, and a warning for a
    role over it (its fixes from the planner)."""
    gib, source = device_memory(device_gb)
    shown = f"{gib:g}"
    try:
        plan = plan_run(cfg, world_size=world_size, target_config=target_config, device_gb=gib)
    except Exception as error:  # a diagnostic only: a planner that cannot plan this run stops nothing
        return [f"[dflash2] note: no memory plan for this run ({type(error).__name__}: {error})"]
    roles = ", ".join(f"{role.role} ranks {role.total() / GIB:.1f} GiB" for role in plan.roles)
    plan_args = shlex.join(["python", "-m", "dflash2.plan", config, *overrides])
    command = f"{plan_args} --world-size {world_size} --device-gb {shown}"
    lines = [f"[dflash2] memory plan per GPU: {roles}, of {shown} GiB ({source}); breakdown: {command}"]
    return lines + [f"[dflash2] warning: the run may run out of GPU memory: {w}" for w in plan.warnings]


def check(config: str, overrides: list[str], world_size: int, device_gb: float | None = None) -> str:
    """The layout of the run on `world_size` GPUs, or a ValueError naming what to fix."""
    cfg = load_run_config(config, overrides)
    check_run_paths(cfg)
    if cfg.train.resume != "auto":
        raise ValueError(
            f"train.resume={cfg.train.resume!r}: a requeued SLURM job resumes only with train.resume=auto "
            "(and a fixed output_dir)"
        )
    data_parallel = cfg.data_parallel_size(world_size)
    if data_parallel < 1:
        raise ValueError(
            f"capture_ranks={cfg.capture_ranks} leaves no trainer among this job's {world_size} GPUs"
        )
    try:
        t = cfg.with_batch_layout(data_parallel).train
    except ValueError as error:
        raise ValueError(f"{error} (this job has {world_size} GPUs)") from None
    if (held := lock_run_dir(cfg.output_dir)) is not None:  # another job's run: refused
        os.close(held)
    plan = resolve_run(cfg, data_parallel)  # the draft config against the target, the backend's files
    if plan.resume_from is not None:  # a requeue resumes it: a checkpoint of another run is refused here
        check_resume(plan.resume_from, plan.contract)
    hint = (
        "" if t.global_batch_size else "; set train.global_batch_size to requeue onto another number of GPUs"
    )
    print(
        f"[dflash2] run config {config}: backend {cfg.backend}, topology {cfg.topology}, output_dir "
        f"{cfg.output_dir}\n[dflash2] global batch {t.micro_batch_size * t.grad_accum_steps * data_parallel}: "
        f"micro-batch {t.micro_batch_size} x {t.grad_accum_steps} accumulation steps x {data_parallel} ranks{hint}",
        f"[dflash2] collectives wait at most {startup_timeout().total_seconds():g} s until a rank's first step "
        f"({STARTUP_TIMEOUT_ENV}: a rank may read a large target while the others wait), "
        f"{collective_timeout().total_seconds():g} s from then on ({TIMEOUT_ENV})",
        *memory_lines(config, overrides, cfg, plan.target_config, world_size, device_gb),
        sep="\n",
        file=sys.stderr,
    )
    return cfg.output_dir


def main(argv: list[str] | None = None) -> int:
    parser = OverridesParser(
        prog="launch/slurm/preflight.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--world-size", type=int, required=True, help="GPUs of this job (all nodes)")
    parser.add_argument(
        "--device-gb",
        type=float,
        default=None,
        help="GiB per GPU for the memory plan (default: this node's GPU 0)",
    )
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)
    if args.device_gb is not None:
        check_positive("--device-gb", args.device_gb)
    # stdout is the output_dir alone, which the batch shell reads: anything else said goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        output_dir = check(args.config, args.overrides, args.world_size, args.device_gb)
    print(output_dir)
    return 0


if __name__ == "__main__":
    exit_process(run_main(main))
