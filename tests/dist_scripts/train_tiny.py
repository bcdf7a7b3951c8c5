"""Launched by tests/test_dist.py (torchrun, 2 ranks, or plain python): exercises one backend end to end.

Writes into --out: per-rank target shard sizes, the target's features (outputs of decoder layers
TARGET_LAYER_IDS) and head, the draft's
initial and final full weights, the data seeds it drew, and (on resume) the contract error message.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash2 import checkpoint  # noqa: E402
from dflash2.capture import target_features  # noqa: E402
from dflash2.checkpoint import find_latest, load_checkpoint  # noqa: E402
from dflash2.config import OptimConfig  # noqa: E402
from dflash2.distributed import build_backend, init_distributed, shutdown_distributed  # noqa: E402
from tests.dist_scripts.tiny import StandInDraft, micro_batch, weighted_loss_sum  # noqa: E402

MICRO_BATCH_SIZE = 3
GRAD_ACCUM_STEPS = 2
TARGET_LAYER_IDS = [1, 0]  # both layers of the 2-layer tiny target, the last one first
CONTRACT = {"architecture": "stand-in", "block_size": 4, "target_layer_ids": [0, 1], "grad_accum_steps": 2}


def target_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 256, (2, 10), generator=gen)
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, 7:] = 0  # right padding in the second row
    return input_ids, attention_mask


def local_and_total_numel(target: torch.nn.Module) -> tuple[int, int]:
    """Elements of the target held by this rank vs the model's full size (DS: ds_tensor; FSDP: DTensor)."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for param in target.parameters():
        if hasattr(param, "ds_tensor"):
            local += param.ds_tensor.numel()
            total += param.ds_numel
        elif isinstance(param, DTensor):
            local += param.to_local().numel()
            total += param.numel()
        else:
            local += param.numel()
            total += param.numel()
    return local, total


def check_target(backend, args, out: Path) -> None:
    target = backend.load_target(args.target_dir, torch.float32)
    local, total = local_and_total_numel(target)
    (out / f"target_numel_rank{backend.rank}.json").write_text(json.dumps({"local": local, "total": total}))
    input_ids, attention_mask = target_inputs()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    features = target_features(backend, target, batch, TARGET_LAYER_IDS)
    head = backend.target_head(target, torch.float32)
    save_file(
        {
            "features": features.cpu().contiguous(),
            "embed": head.embed_weight.cpu().contiguous(),
            "lm_head": head.lm_head_weight.cpu().contiguous(),
        },
        str(out / f"target_rank{backend.rank}.safetensors"),
    )


def compare_with_full_load(backend, target_dirs: list[str], out: Path) -> None:
    """Load each target (in fp32, and the first one also in bf16) with the backend and with a plain
    `from_pretrained` (the full load) in this process; save both loads' features, non-persistent
    buffers and head, and whether ties survived."""
    from transformers import AutoModelForCausalLM

    input_ids, attention_mask = target_inputs()
    loads = [(d, torch.float32) for d in target_dirs] + [(d, torch.bfloat16) for d in target_dirs[:1]]
    for index, (target_dir, dtype) in enumerate(loads):
        loaded = {"backend": backend.load_target(target_dir, dtype)}
        loaded["full"] = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
        tensors, tied = {}, {}
        for name, model in loaded.items():
            every_layer = list(range(model.config.num_hidden_layers))
            batch = {"input_ids": input_ids, "attention_mask": attention_mask}
            tensors[f"{name}.hidden"] = target_features(backend, model, batch, every_layer).cpu().contiguous()
            persistent = set(model.state_dict())
            for key, buffer in model.named_buffers():
                if key not in persistent:
                    tensors[f"{name}.buffer.{key}"] = buffer.cpu().contiguous()
            head = backend.target_head(model, torch.float32)
            tensors[f"{name}.lm_head"] = head.lm_head_weight.cpu().contiguous()
            tied[name] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        save_file(tensors, str(out / f"load{index}_rank{backend.rank}.safetensors"))
        (out / f"load{index}_tied_rank{backend.rank}.json").write_text(json.dumps(tied))


def draw_seed() -> int:
    """Consumes torch, python and numpy RNG, so a resume is exact only if all three are restored."""
    return (
        int(torch.randint(0, 2**20, (1,))) + random.randrange(2**20) + int(np.random.randint(2**20))
    ) % 2**30


def train(backend, args, out: Path) -> None:
    optim = OptimConfig(lr=1e-2, max_steps=args.steps, warmup_steps=1, weight_decay=0.01, max_grad_norm=0.5)
    torch.manual_seed(0)  # the same initial draft on every rank
    draft = backend.setup_draft(StandInDraft(), optim, args.precision)
    initial = backend.full_draft_state_dict()
    torch.manual_seed(100 + backend.rank)
    random.seed(200 + backend.rank)
    np.random.seed(300 + backend.rank)

    start = 0
    run_dir = Path(args.run_dir)
    if args.resume:
        ckpt = find_latest(run_dir)
        try:
            load_checkpoint(backend, ckpt, contract={**CONTRACT, "block_size": 8, "num_anchors": 3})
        except ValueError as err:
            (out / f"contract_error_rank{backend.rank}.txt").write_text(str(err))
        start = load_checkpoint(backend, ckpt, contract=CONTRACT)["step"]

    seeds, stats = [], []
    for step in range(start, args.steps):
        data_seed = draw_seed()
        seeds.append(data_seed)
        batches = [micro_batch(data_seed, micro, backend.rank, MICRO_BATCH_SIZE) for micro in range(2)]
        weight_sum = backend.all_reduce_sum(sum(b[2].sum() for b in batches))
        for x, labels, weights in batches:
            loss = weighted_loss_sum(
                draft(x.to(backend.device, backend.compute_dtype)),
                labels.to(backend.device),
                weights.to(backend.device),
            )
            backend.backward(loss / weight_sum)
        stats.append(backend.step())
        if step + 1 == args.save_at:
            checkpoint.save_checkpoint(
                backend,
                run_dir,
                step + 1,
                draft_config={"width": 32},
                contract=CONTRACT,
                train_state={"epoch": 0, "step_in_epoch": step + 1},
                keep_last=2,
            )

    final = backend.full_draft_state_dict()
    (out / f"seeds_rank{backend.rank}.json").write_text(json.dumps(seeds))
    if backend.is_main:
        save_file(initial, str(out / "initial.safetensors"))
        save_file(final, str(out / "final.safetensors"))
        (out / "stats.json").write_text(json.dumps(stats))
    if args.crash_in_final_save:
        # rank 0 dies just before the rename that would publish the checkpoint
        checkpoint.os.rename = lambda *_: os._exit(3)
        checkpoint.save_checkpoint(
            backend, run_dir, args.steps, draft_config={}, contract=CONTRACT, train_state={}, keep_last=2
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--ds-config", default=None)
    parser.add_argument("--target-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--skip-target", action="store_true")
    parser.add_argument("--compare-load", nargs="*", default=[], help="targets to load both ways")
    parser.add_argument("--crash-in-final-save", action="store_true")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    args = parser.parse_args()

    init_distributed(args.backend)
    backend = build_backend(args.backend, args.ds_config, MICRO_BATCH_SIZE, GRAD_ACCUM_STEPS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.skip_target:
        check_target(backend, args, out)
    compare_with_full_load(backend, args.compare_load, out)
    train(backend, args, out)
    shutdown_distributed()  # torn down before exit, as a run does: left to exit handlers a rank may abort


if __name__ == "__main__":
    main()
