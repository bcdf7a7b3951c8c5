"""Is bf16 fast on this CPU? One matrix product of a decoder's shape in fp32 and in bf16.

Prints the GFLOP/s of each and whether /proc/cpuinfo lists bf16 instructions (dflash2.hardware, the
check behind `launch/demo_real.py --precision auto` and the slow-bf16 warning of training, capture,
evaluation and regeneration). The product: `--rows` tokens through a [576, 1536] projection
(SmolLM2-135M's MLP), on `--threads` threads.

    .venv/bin/python benchmarks/cpu_bf16.py
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash2.hardware import cpu_has_native_bf16


def gflops(rows: int, inner: int, outer: int, dtype: torch.dtype, seconds: float) -> float:
    """GFLOP/s of repeated [rows, inner] x [inner, outer] products for about `seconds`."""
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, outer, dtype=dtype)
    for _ in range(2):  # warm-up: the kernel's first call builds its plan
        a @ b
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 3:
        a @ b
        count += 1
    return 2 * rows * inner * outer * count / elapsed / 1e9


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=1.0, help="per dtype")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "native_bf16": cpu_has_native_bf16(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **{
            f"gflops_{name}": round(gflops(args.rows, 576, 1536, dtype, args.seconds), 1)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        },
    }
    result["bf16_over_fp32"] = round(result["gflops_bf16"] / result["gflops_fp32"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
