"""Replace every assistant turn of a training_jsonl file with the target's own greedy reply.

Local target:  --target <hf dir> [--device cuda] [--dtype bfloat16]
Server:        --server-url http://host:port --model <served name>   (SGLang / vLLM, OpenAI API)
Rerunning with the same --out resumes: ids already written are skipped.
"""

from __future__ import annotations

import argparse
import json
import logging

from dflash2.config import require_path
from dflash2.data.regenerate import LocalTargetGenerator, ServerGenerator, regenerate_file
from dflash2.errors import add_debug_flag, exit_process, run_main


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, help="training_jsonl file to regenerate")
    parser.add_argument("--out", required=True, help="output JSONL (appended to; resumes when it exists)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", help="local Hugging Face target directory")
    source.add_argument("--server-url", help="OpenAI-compatible server root, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model", help="model name the server serves (required with --server-url)")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="conversations per generate call / in flight"
    )
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="longest reply, in tokens")
    parser.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        help="JSON for the chat template, e.g. '{\"enable_thinking\": false}' (local rendering and server)",
    )
    parser.add_argument(
        "--device", default=None, help="local target device (default: cuda if available, else cpu)"
    )
    parser.add_argument("--dtype", default="auto", help="local target dtype: auto, bfloat16 or float32")
    parser.add_argument("--on-error", choices=("skip", "fail"), default="skip", help="malformed input lines")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.server_url and not args.model:
        parser.error("--model is required with --server-url (the name the server serves)")
    require_path(args.input, "--input", "file", "a training_jsonl file")
    if args.target:
        require_path(args.target, "--target", "dir", "the target's local model directory")
    return args


def _local_generator(args: argparse.Namespace) -> LocalTargetGenerator:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash2.hardware import warn_if_slow_bf16

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    warn_if_slow_bf16(torch.device(device), model.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    return LocalTargetGenerator(model, tokenizer, args.max_new_tokens, args.chat_template_kwargs)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.server_url:
        generator = ServerGenerator(
            args.server_url,
            args.model,
            args.max_new_tokens,
            args.chat_template_kwargs,
            concurrency=args.batch_size,
        )
    else:
        generator = _local_generator(args)
    counts = regenerate_file(
        args.input, args.out, generator, batch_size=args.batch_size, on_error=args.on_error
    )
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    exit_process(run_main(main))
