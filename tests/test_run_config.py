"""Run config: YAML + dotted overrides, unknown keys and bad values are errors naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

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


def test_a_section_given_whole_and_overrides_given_as_a_dict_or_a_string_are_refused():
    """`train={max_steps: 5}` replaced the whole section: the run trained with the train section's
    defaults (another lr, global batch and warmup), silently; a dict of overrides was read as its keys."""
    config = ROOT / "configs/tiny-dflash2.yaml"
    with pytest.raises(ValueError, match=re.escape(
        "override 'train={max_steps: 5, lr: 1e-3}' would replace the whole train section, its other keys back "
        "to their defaults: set the keys one by one (train.max_steps=5 train.lr=1e-3)"
    )):  # fmt: skip
        load_run_config(config, ["train={max_steps: 5, lr: 1e-3}"])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "whole objective section, its other keys back to their defaults: set the keys one by one (objective.<key>=<value>)"
        ),
    ):
        load_run_config(config, ["objective={}"])
    kwargs = load_run_config(config, ["data.chat_template_kwargs={enable_thinking: false}"])  # a field's dict
    assert kwargs.data.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match=re.escape(
        "overrides: give a list of key=value strings, e.g. ['train.max_steps=2', 'output_dir=/tmp/x'], not a dict"
    )):  # fmt: skip
        load_run_config(config, {"train.max_steps": 2, "output_dir": "/tmp/x"})
    with pytest.raises(ValueError, match=re.escape("e.g. ['train.max_steps=2'], not one string")):
        load_run_config(config, "train.max_steps=2")


def test_a_yaml_number_without_a_dot_is_read_as_the_number(tmp_path):
    # YAML 1.1 reads `lr: 3e-4` as the string "3e-4": still the number, and `export: yes` a flag
    path = tmp_path / "run.yaml"
    path.write_text((ROOT / "configs/tiny-dflash2.yaml").read_text() + "\n")
    tree = yaml.safe_load(path.read_text())
    tree["train"].update({"lr": "3e-4", "export": True})
    path.write_text(yaml.safe_dump(tree).replace("'3e-4'", "3e-4").replace("export: true", "export: yes"))
    assert yaml.safe_load(path.read_text())["train"]["lr"] == "3e-4"  # what YAML gives the config
    cfg = load_run_config(path)
    assert cfg.train.lr == 3e-4 and cfg.train.export is True


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.max_stpes=3", "train.max_stpes: Extra inputs are not permitted"),
        ("backend=horovod", "backend: Input should be 'deepspeed', 'fsdp' or 'local'"),
        ("train.max_steps=0", "train.max_steps: Input should be greater than or equal to 1"),
        ("objective.selector_mode=soft", "objective.selector_mode"),
        ("topology=disaggregated", "capture_ranks >= 1"),
        ("train.global_batch_size=0", "train.global_batch_size: Input should be greater than or equal to 1"),
        ("train.warmup_steps=-1", "train.warmup_steps"),
        ("train.max_steps", "must look like key=value"),
        # true/false for a number, a number or a word for a flag: pydantic alone reads them as 1 and true
        ("train.max_steps=true", "train.max_steps: give a number, not true"),
        ("train.lr=false", "train.lr: give a number, not false"),
        ("objective.num_anchors=true", "objective.num_anchors: give a number, not true"),
        ("train.export=1", "train.export: Input should be a valid boolean"),
        ("model.init_from_target=on_disk", "model.init_from_target: Input should be a valid boolean"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_run_config(ROOT / "configs/tiny-dflash2.yaml", override.split(" "))


def test_a_numpy_bool_is_no_number_either():
    """From Python a config value may be a numpy scalar: numpy's bool is refused like Python's, its
    integers are taken."""
    import numpy as np

    from dflash2.config import ObjectiveSection, OptimConfig

    with pytest.raises(ValueError, match="max_steps\n.*give a number, not true"):
        OptimConfig(max_steps=np.bool_(True))
    with pytest.raises(ValueError, match="loss_gamma\n.*give a number, not false"):
        ObjectiveSection(loss_gamma=np.bool_(False))
    assert OptimConfig(max_steps=np.int64(5)).max_steps == 5


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


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("train.max_step=5", "train.max_step: Extra inputs are not permitted; did you mean train.max_steps?"),
        ("objective.num_anchor=8", "did you mean objective.num_anchors?"),
        ("trian.max_steps=5", "trian: Extra inputs are not permitted; did you mean train?"),
        ("outputdir=runs/x", "did you mean output_dir?"),
    ],
)
def test_unknown_keys_suggest_the_nearest_valid_key(override, suggestion, tmp_path):
    with pytest.raises(ValueError) as err:
        load_run_config(ROOT / "configs/tiny-dflash2.yaml", [override])
    assert suggestion in str(err.value)
    # the same key written in the YAML file
    key, value = override.split("=")
    tree = yaml.safe_load((ROOT / "configs/tiny-dflash2.yaml").read_text())
    *sections, leaf = key.split(".")
    node = tree
    for section in sections:
        node = node.setdefault(section, {})
    node[leaf] = yaml.safe_load(value)
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(ValueError) as err:
        load_run_config(tmp_path / "typo.yaml")
    assert suggestion in str(err.value)


def test_a_key_far_from_every_valid_one_gets_no_suggestion():
    with pytest.raises(ValueError) as err:
        load_run_config(ROOT / "configs/tiny-dflash2.yaml", ["train.zzzqqq=1"])
    assert str(err.value).endswith("train.zzzqqq: Extra inputs are not permitted")


SHIPPED = sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("configs/recipes/*.yaml")])


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_fixes_its_global_batch(path):
    """The global batch, not the accumulation steps, is what a shipped config sets: a run resumed on
    another number of GPUs (a SLURM requeue onto fewer nodes) continues with the same batch."""
    cfg = load_run_config(path)
    assert cfg.train.global_batch_size is not None
    assert "grad_accum_steps" not in path.read_text()  # ignored once the global batch is set


def test_the_8gpu_recipe_runs_its_documented_batch_on_one_or_two_nodes():
    cfg = load_run_config(ROOT / "configs/recipes/qwen3.6-27b-dflash2-8gpu-zero3.yaml")
    for ranks, accumulation in ((8, 4), (16, 2)):  # one node, and the 2-node sbatch of launch/slurm
        train = cfg.with_batch_layout(ranks).train
        assert (train.grad_accum_steps, train.micro_batch_size * train.grad_accum_steps * ranks) == (
            accumulation,
            32,
        )
    assert "32 sequences" in (ROOT / "configs/recipes/qwen3.6-27b-dflash2-8gpu-zero3.yaml").read_text()
