"""Run config: YAML + dotted overrides, unknown keys and bad values are errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash2.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["tiny-dflash2.yaml", "tiny-dflash.yaml"])
def test_shipped_tiny_configs_validate(name):
    cfg = load_run_config(ROOT / "configs" / name)
    assert cfg.backend == "deepspeed" and cfg.train.max_steps > 0


def test_overrides_are_typed_and_validated():
    cfg = load_run_config(
        ROOT / "configs/tiny-dflash2.yaml",
        [
            "output_dir=/tmp/x",
            "train.max_steps=7",
            "backend=fsdp",
            "train.lr=1e-3",
            "objective.loss_gamma=null",
        ],
    )
    assert (cfg.output_dir, cfg.train.max_steps, cfg.backend) == ("/tmp/x", 7, "fsdp")
    assert cfg.train.lr == 1e-3 and cfg.objective.loss_gamma is None


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.max_stpes=3", "train.max_stpes: Extra inputs are not permitted"),
        ("backend=horovod", "backend: Input should be 'deepspeed' or 'fsdp'"),
        ("train.max_steps=0", "train.max_steps: Input should be greater than or equal to 1"),
        ("objective.selector_mode=soft", "objective.selector_mode"),
        ("topology=disaggregated", "capture_ranks >= 1"),
        ("train.global_batch_size=0", "train.global_batch_size: Input should be greater than or equal to 1"),
        ("train.warmup_steps=-1", "train.warmup_steps"),
        ("train.max_steps", "must look like key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_run_config(ROOT / "configs/tiny-dflash2.yaml", override.split(" "))


def test_global_batch_size_decides_the_accumulation_steps_for_the_ranks():
    cfg = load_run_config(
        ROOT / "configs/tiny-dflash2.yaml",
        [
            "output_dir=x",
            "train.micro_batch_size=2",
            "train.grad_accum_steps=5",
            "train.global_batch_size=16",
        ],
    )
    assert [cfg.with_batch_layout(ranks).train.grad_accum_steps for ranks in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ValueError, match="global_batch_size=16 is not a multiple of micro_batch_size 2 x 3"):
        cfg.with_batch_layout(3)
    unset = cfg.model_copy(update={"train": cfg.train.model_copy(update={"global_batch_size": None})})
    assert unset.with_batch_layout(4).train.grad_accum_steps == 5  # without it, the config's value
    disaggregated = cfg.model_copy(update={"topology": "disaggregated", "capture_ranks": 2})
    assert disaggregated.data_parallel_size(6) == 4 and cfg.data_parallel_size(6) == 6
