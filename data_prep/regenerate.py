"""Replace every assistant turn of a training_jsonl file with the target's own greedy reply.

Local target:  --target <hf dir> [--device cuda] [--dtype bfloat16]
Server:        --server-url http://host:port --model <served name>   (SGLang / vLLM, OpenAI API)
Rerunning with the same --out resumes: ids already written are skipped.

With a local target, `--capture-config <run yaml> --features-out <dir> [key=value ...]` also keeps the
run's features from the generation's own forwards and writes the features directory that run trains
from (data.features_dir), as data_prep/capture.py would, without a second pass over the data. The run
config's data.train is --out; its target, dtype and chat template are the regeneration's.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dflash2.config import json_object_arg, load_tokenizer, require_path, torch_dtype
from dflash2.data.regenerate import LocalTargetGenerator, ServerGenerator, regenerate_file
from dflash2.errors import add_debug_flag, exit_process, run_main

# --dtype: the run configs' precision names, and torch's for the same dtypes
DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}


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
        type=json_object_arg,
        default=None,
        help="JSON for the chat template, e.g. '{\"enable_thinking\": false}' (local rendering and server)",
    )
    parser.add_argument(
        "--device", default=None, help="local target device (default: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPES),
        help="local target dtype (bf16 and bfloat16, fp32 and float32 are the same; auto: the checkpoint's)",
    )
    parser.add_argument(
        "--on-error",
        choices=("skip", "fail"),
        default="skip",
        help="malformed input lines, and conversations the server refuses or answers empty",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="server: seconds to wait for one reply before asking again",
    )
    parser.add_argument(
        "--capture-config", help="run config YAML whose features to keep while regenerating (local target)"
    )
    parser.add_argument("--features-out", help="features directory to write (with --capture-config)")
    parser.add_argument(
        "--shard-mb",
        type=int,
        default=2048,
        help="with --capture-config: MiB per shard of the forwards it adds",
    )
    add_debug_flag(parser)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of --capture-config")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.server_url and not args.model:
        parser.error("--model is required with --server-url (the name the server serves)")
    if bool(args.capture_config) != bool(args.features_out):
        parser.error("--capture-config and --features-out go together")
    if args.capture_config and not args.target:
        parser.error("--capture-config needs a local --target (a server's forwards cannot be read)")
    if args.overrides and not args.capture_config:
        parser.error(f"unexpected arguments {args.overrides} (key=value overrides need --capture-config)")
    require_path(args.input, "--input", "file", "a training_jsonl file")
    if Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a directory: give the JSONL file to write")
    if Path(args.out).resolve() == Path(args.input).resolve():
        parser.error("--out is --input: give another file (the replies are written beside the prompts)")
    if args.target:
        require_path(args.target, "--target", "dir", "the target's local model directory")


def _local_target(args: argparse.Namespace, dtype):
    import torch

    from dflash2.hardware import warn_if_slow_bf16
    from dflash2.target.load import load_full_target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_full_target(args.target, dtype, device)
    warn_if_slow_bf16(torch.device(device), model.dtype)
    return model


def _local_generator(args: argparse.Namespace) -> LocalTargetGenerator:
    tokenizer = load_tokenizer(args.target, "--target")
    model = _local_target(args, args.dtype if args.dtype == "auto" else torch_dtype(DTYPES[args.dtype]))
    return LocalTargetGenerator(model, tokenizer, args.max_new_tokens, args.chat_template_kwargs)


def _regenerate_and_capture(args: argparse.Namespace) -> dict:
    """--capture-config: the run config decides the target's dtype and chat template; --target,
    --dtype and --chat-template-kwargs may only agree with it."""
    from dflash2.config import check_model_paths, load_run_config
    from dflash2.run import regenerate_and_capture

    cfg = load_run_config(args.capture_config, [*args.overrides, f"data.train={args.out}"])
    check_model_paths(cfg)
    if Path(cfg.model.target).resolve() != Path(args.target).resolve():
        raise ValueError(
            f"--target {args.target} is not the run config's model.target ({cfg.model.target}); the features "
            "must be the target's the run trains with: pass the same directory (or override model.target=...)"
        )
    dtype = cfg.target_torch_dtype
    if args.dtype != "auto" and torch_dtype(DTYPES[args.dtype]) != dtype:
        raise ValueError(
            f"--dtype {args.dtype} is not the run's target dtype ({dtype}, from precision / model.target_dtype); "
            "leave --dtype out with --capture-config"
        )
    if args.chat_template_kwargs is not None and args.chat_template_kwargs != dict(
        cfg.data.chat_template_kwargs
    ):
        raise ValueError(
            "--chat-template-kwargs differ from the run config's data.chat_template_kwargs; set them in the run "
            "config (or as an override) and leave --chat-template-kwargs out"
        )
    if args.batch_size < 1 or args.shard_mb < 1:
        raise ValueError(f"--batch-size ({args.batch_size}) and --shard-mb ({args.shard_mb}) must be >= 1")
    return regenerate_and_capture(
        cfg,
        args.input,
        _local_target(args, dtype),
        args.features_out,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        on_error=args.on_error,
        shard_bytes=args.shard_mb << 20,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.capture_config:
        print(json.dumps(_regenerate_and_capture(args)))
        return 0
    if args.server_url:
        generator = ServerGenerator(
            args.server_url,
            args.model,
            args.max_new_tokens,
            args.chat_template_kwargs,
            concurrency=args.batch_size,
            timeout_s=args.timeout_s,
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
