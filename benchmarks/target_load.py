"""Benchmark FSDP2 target loading: peak host memory per rank, full load vs sharded load.

A random Qwen3 target of about `--size-gb` (fp32, untied LM head) is saved with `save_pretrained`
into a temporary directory (or `--target-dir` names an existing one). Then, for each method, a
fresh `torchrun --nproc_per_node --ranks` job loads it with FSDP2:

  full       every rank runs `from_pretrained` (the whole target in host memory), then `fully_shard`
             keeps its shard: how the FSDP2 backend loaded targets before sharded loading
  sharded    `FSDPBackend.load_target`: built on the meta device, sharded, each rank reads its rows
             of every tensor with plain file reads (dflash2.target.load)
  mmap       the same, but the rows are read by torch.distributed.checkpoint's Hugging Face reader
             (`dcp.load` with `HuggingFaceStorageReader`), which slices tensors through a memory map
  broadcast  built on meta and sharded; rank 0 runs `from_pretrained` and sends every rank its
             shards: `set_model_state_dict(..., StateDictOptions(full_state_dict=True,
             broadcast_from_rank0=True))`

Each rank resets the kernel's peak-RSS mark (`/proc/self/clear_refs`, Linux) just before loading,
takes the current RSS as its baseline and reports `VmHWM - baseline` (the peak increase) after the
load, as a multiple of the target's size on disk. Every method then runs the same forward;
its features (every decoder layer's output) are compared bitwise with the
full load's.

Example (docs/benchmarks.md has the recorded run):
    .venv/bin/python benchmarks/target_load.py --size-gb 1.1 --json /tmp/target_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a plain script from any directory
    sys.path.insert(0, str(REPO_ROOT))

METHODS = ("full", "sharded", "mmap", "broadcast")
REQUIRED_RATIO = 0.6  # each rank's peak increase, as a fraction of the target's size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--size-gb", type=float, default=1.1, help="approximate target size (GB = 1e9 bytes, fp32)")
    add("--target-dir", default=None, help="load this saved target instead of building one")
    add("--ranks", type=int, default=2, help="processes (FSDP2 ranks)")
    add("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="`full` is always run")
    add("--json", default=None, help="also write the report here")
    add("--worker", choices=METHODS, default=None, help=argparse.SUPPRESS)
    add("--out-dir", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------ the target


def qwen3_config(size_gb: float):
    """A Qwen3 of hidden 1024 (16 heads / 8 KV heads of 64, MLP 3072, vocab 32000) whose layer count
    brings the fp32 parameters to about `size_gb`."""
    from transformers import Qwen3Config

    hidden, intermediate, vocab = 1024, 3072, 32000
    per_layer = 2 * hidden * hidden + 2 * hidden * 512 + 3 * hidden * intermediate + 4 * 64 + 2 * hidden
    embeddings = 2 * vocab * hidden  # untied embedding and LM head
    num_layers = max(1, round((size_gb * 1e9 / 4 - embeddings) / per_layer))
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def save_random_target(size_gb: float, target_dir: Path) -> None:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(qwen3_config(size_gb)).save_pretrained(str(target_dir))


def target_bytes(target_dir: Path) -> int:
    return sum(f.stat().st_size for f in target_dir.glob("*.safetensors"))


# ------------------------------------------------------------------ one rank


def _import_loaders() -> None:
    """What `load` imports, whichever method it runs (a later import is a dict lookup)."""
    import torch.distributed.checkpoint  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import dflash2.target.load  # noqa: F401


def load(method: str, backend, target_dir: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    from dflash2.target import load as sharded_load

    if method == "sharded":
        return backend.load_target(target_dir, torch.float32)
    if method == "full":
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        backend._shard(model, backend.target_mesh)
        return model
    model = sharded_load.build_on_meta(target_dir, torch.float32)
    reader = HuggingFaceStorageReader(target_dir)
    names = sharded_load.checkpoint_names(model, list(reader.read_metadata().state_dict_metadata))
    backend._shard(model, backend.target_mesh)
    model.to_empty(device=backend.device)
    if method == "mmap":
        dcp.load(sharded_load._tensors_to_read(model, names), storage_reader=reader)
    else:  # broadcast
        full = {}
        if dist.get_rank() == 0:
            full = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).state_dict()
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)
        del full
    sharded_load.init_non_persistent_buffers(model)
    return model


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from dflash2.capture import target_features
    from dflash2.distributed import build_backend, init_distributed, shutdown_distributed
    from dflash2.hardware import status_kib

    init_distributed("fsdp")
    backend = build_backend("fsdp", None, 1, 1)
    _import_loaders()  # their imports (73 MiB) are no method's cost: before the mark is reset
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    baseline_kib = status_kib("VmRSS")
    target = load(args.worker, backend, args.target_dir)
    peak_kib = status_kib("VmHWM")
    input_ids = torch.randint(0, 32000, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    every_layer = list(range(target.config.num_hidden_layers))
    features = target_features(backend, target, batch, every_layer)
    out, rank = Path(args.out_dir), dist.get_rank()
    if rank == 0:
        save_file({"hidden": features.contiguous()}, str(out / "features.safetensors"))
    result = {"rank": rank, "baseline_kib": baseline_kib, "peak_kib": peak_kib}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    shutdown_distributed()


# ------------------------------------------------------------------ driver


def run_method(args: argparse.Namespace, method: str, target_dir: Path, out: Path) -> list[dict]:
    """One torchrun job; each rank writes rank<r>.json, rank 0 also features.safetensors, into `out`."""
    out.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
        __file__, "--worker", method, "--target-dir", str(target_dir), "--out-dir", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} load failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(args.ranks)]


def measure(args: argparse.Namespace, target_dir: Path, work_dir: Path) -> dict:
    size = target_bytes(target_dir)
    report = {"target_bytes": size, "ranks": args.ranks, "methods": {}}
    features = {}
    for method in ["full", *(m for m in args.methods if m != "full")]:
        ranks = run_method(args, method, target_dir, work_dir / method)
        features[method] = work_dir / method / "features.safetensors"
        for rank in ranks:
            rank["increase_bytes"] = (rank["peak_kib"] - rank["baseline_kib"]) * 1024
            rank["increase_ratio"] = round(rank["increase_bytes"] / size, 3)
        report["methods"][method] = ranks
    reference = load_file(str(features["full"]))["hidden"]
    report["features_identical_to_full"] = {
        method: bool(torch.equal(reference, load_file(str(path))["hidden"]))
        for method, path in features.items()
    }
    if "sharded" in report["methods"]:
        worst = max(rank["increase_ratio"] for rank in report["methods"]["sharded"])
        report["sharded_meets_requirement"] = worst <= REQUIRED_RATIO
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("peak RSS needs Linux /proc/self/clear_refs")
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = Path(args.target_dir) if args.target_dir else Path(tmp) / "target"
        if not args.target_dir:
            save_random_target(args.size_gb, target_dir)
        report = measure(args, target_dir, Path(tmp))
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
