"""What this machine computes fast: bf16 on a CPU only where the CPU has bf16 instructions.

Without them (an AVX2-only x86 CPU, say) PyTorch emulates bf16 matrix products: a [256, 576] x
[576, 1536] product ran at 1.2 GFLOP/s in bf16 against 87 GFLOP/s in fp32 on one core of an AVX2
EPYC (docs/training.md, "bf16 on a CPU"), so a bf16 run there is tens of times slower, not faster.
"""

from __future__ import annotations

from pathlib import Path

import torch

# /proc/cpuinfo flags of CPUs that compute bf16 products natively: x86 AVX-512 BF16 and AMX (the
# "flags" line), Arm's BF16 extension (the "Features" line)
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
CPUINFO = Path("/proc/cpuinfo")
PROC_STATUS = Path("/proc/self/status")
NO_BF16 = f"none of {', '.join(sorted(NATIVE_BF16_FLAGS))} in {CPUINFO}"


def status_kib(field: str) -> int:
    """A memory field of this process's /proc/self/status (VmRSS, VmHWM, ...: Linux), in KiB."""
    for line in PROC_STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{PROC_STATUS} has no {field}")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where it cannot be read: not Linux)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether the CPU has bf16 instructions (unknown counts as no: fp32 is never the slow choice)."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags(cpuinfo))


def default_cpu_precision(cpuinfo: Path = CPUINFO) -> tuple[str, str]:
    """("bf16" | "fp32", why) for a run on this CPU: bf16 only where it has bf16 instructions."""
    if cpu_has_native_bf16(cpuinfo):
        return "bf16", "bf16: this CPU has bf16 instructions"
    return "fp32", f"fp32: {NO_BF16}, where bf16 runs tens of times slower; --precision bf16 to run it anyway"


def slow_bf16_warning(device: torch.device, *dtypes: torch.dtype, cpuinfo: Path = CPUINFO) -> str | None:
    """One line for a run on `device` that computes in bf16 (one of `dtypes`) on a CPU without bf16
    instructions, else None."""
    if torch.bfloat16 not in dtypes or device.type != "cpu" or cpu_has_native_bf16(cpuinfo):
        return None
    return (
        f"warning: bf16 on a CPU without bf16 instructions ({NO_BF16}): its matrix products are "
        "emulated, tens of times slower than fp32; use fp32 on this machine (precision=fp32, "
        "--precision fp32 or --dtype float32)"
    )


def warn_if_slow_bf16(device: torch.device, *dtypes: torch.dtype, is_main: bool = True) -> None:
    """Print slow_bf16_warning's line, if any (by the main rank only)."""
    warning = slow_bf16_warning(device, *dtypes)
    if warning and is_main:
        print(f"[dflash2] {warning}", flush=True)


def check_device(device: str | torch.device, option: str = "--device") -> torch.device:
    """`device` as a torch.device this machine has, else a ValueError naming `option` and the fix."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{option} {device!r} is not a device: use cpu, or cuda / cuda:N on a GPU machine"
        ) from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{option} {device}: this machine has no usable CUDA device; use --device cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(
                f"{option} {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    elif parsed.type != "cpu":
        raise ValueError(f"{option} {device}: evaluation runs on cpu or cuda")
    return parsed
