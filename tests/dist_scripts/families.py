"""Launched by tests/test_target_families.py (torchrun, 2 ranks): every target family through one backend.

For each family directory under --families-dir, in one process group:
  online   the features of a right-padded batch of 2, captured through the backend's sharded target
  offline  the offline capture of the data (capture_to_dir, what data_prep/capture.py runs), with the
           same sharded target
  train    a few optimizer steps of the real training code (build_setup + fit), which exports
Writes into --out/<family>/: online.safetensors (rank 0), features/ (the offline capture), run/
(metrics.jsonl, export/). A family that fails leaves error_rank<r>.txt and ends the launch.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash2.capture import target_features  # noqa: E402
from dflash2.capture.offline import capture_to_dir  # noqa: E402
from dflash2.config import load_run_config  # noqa: E402
from dflash2.distributed import build_backend, init_distributed, shutdown_distributed  # noqa: E402
from dflash2.run_plan import resolve_run  # noqa: E402
from dflash2.train import build_setup, fit  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the second right-padded: the shape every training batch has."""
    gen = torch.Generator().manual_seed(11)
    input_ids = torch.randint(4, 1000, (2, 12), generator=gen)
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, 8:] = 0
    input_ids[1, 8:] = 0  # the pad id
    return input_ids, attention_mask


def family_config(args, family_dir: Path, out: Path):
    overrides = [
        f"model.target={family_dir}",
        f"model.draft_config={args.draft_config}",
        f"data.train={args.data}",
        "data.max_length=64",
        "data.chat_template_kwargs={enable_thinking: false}",  # recorded in the export
        f"backend={args.backend}",
        "objective.num_anchors=8",
        "train.micro_batch_size=2",
        "train.global_batch_size=null",  # the accumulation steps of the overrides, on any number of ranks
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.save_every=0",
        "train.resume=none",
        "train.export=true",
        "train.log_every=1",
        "train.progress_bar=false",
        f"output_dir={out / 'run'}",
    ]
    if args.ds_config:
        overrides.append(f"ds_config={args.ds_config}")
    return load_run_config(REPO / "configs" / "tiny-dflash2.yaml", overrides)


def run_family(args, family_dir: Path, out: Path) -> None:
    cfg = family_config(args, family_dir, out)
    backend = build_backend(cfg.backend, cfg.ds_config if cfg.backend == "deepspeed" else None, 2, 1)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    setup = build_setup(resolve_run(cfg, 2), backend)
    input_ids, attention_mask = padded_batch()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    features = target_features(backend, setup.target, batch, setup.layer_ids)
    if backend.is_main:
        save_file({"features": features.cpu().contiguous()}, str(out / "online.safetensors"))
    capture_to_dir(
        cfg,
        backend,
        setup.target,
        setup.dataset,
        setup.layer_ids,
        out / "features",
        hidden_size=setup.head.embed_weight.shape[1],
        pad_token_id=setup.pad_token_id,
        batch_size=2,
        shard_bytes=1 << 20,
    )
    fit(setup)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--ds-config", default=None)
    parser.add_argument("--families-dir", required=True)
    parser.add_argument("--families", required=True, help="comma-separated family names")
    parser.add_argument("--draft-config", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    args = parser.parse_args()
    init_distributed(args.backend)
    for name in args.families.split(","):
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        try:
            run_family(args, Path(args.families_dir) / name, out)
        except Exception:  # recorded where the test of that family looks; the launch then fails
            (out / f"error_rank{dist.get_rank()}.txt").write_text(traceback.format_exc())
            raise
    shutdown_distributed()


if __name__ == "__main__":
    main()
