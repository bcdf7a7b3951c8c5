"""Hugging Face export of a draft for SGLang and the reference loader, and the `--check` validator.

An export is a directory with ``config.json`` (contract section 3) and ``model.safetensors`` (section 4),
plus ``training_run.json`` when it comes from a training run (its step and chat template arguments,
read by evaluation; servers and the reference loader ignore it).
The servers drop unknown tensor names silently and never report missing ones, so both the export and
``--check`` compare the complete name set and every shape against ``expected_tensor_shapes``.

    python -m dflash2.export <checkpoint-or-model-dir> <out_dir> [--dtype bf16|fp32] [--tokenizer DIR] [--target DIR]
    python -m dflash2.export --check <dir> [--tokenizer DIR] [--target DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash2.checkpoint import (
    CONTRACT,
    DRAFT_CONFIG,
    DRAFT_WEIGHTS,
    holds_draft,
    read_contract,
    read_draft,
    read_train_state,
)
from dflash2.config import PRECISIONS, load_tokenizer, require_path, torch_dtype
from dflash2.errors import add_debug_flag, exit_process, run_main
from dflash2.models.config import (
    REQUIRED_BACKBONE_KEYS,
    draft_value,
    load_config_dict,
    normalize_draft_config,
    to_qwen3_config,
    validate_draft_config,
)
from dflash2.models.registry import expected_tensor_shapes
from dflash2.safetensors_io import save_tensors
from dflash2.target.files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, load_weights, weight_files

CONFIG_NAME = CONFIG_FILE
WEIGHTS_NAME = SINGLE_FILE
# What evaluation needs to know of the run that trained an export: {"step": int, "chat_template_kwargs": dict}
# (either may be absent). A file of its own, so config.json stays exactly the contract.
TRAINING_RUN_NAME = "training_run.json"

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
# safetensors header dtype codes -> the names config.json uses.
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}

# Backbone fields written explicitly, so no loader falls back to a default of its own.
EXPORT_BACKBONE_KEYS = (
    *REQUIRED_BACKBONE_KEYS,
    "hidden_act",
    "rms_norm_eps",
    "attention_bias",
    "max_position_embeddings",
    "tie_word_embeddings",
    "layer_types",
)
BORROWED_NAMES = ("embed_tokens", "lm_head")


# ---------------------------------------------------------------------------------------------------------
# Config and tensors of an export
# ---------------------------------------------------------------------------------------------------------


def export_config(cfg: dict, dtype: torch.dtype) -> dict:
    """The config.json of an export: normalised, backbone fields explicit, dtype fields naming ``dtype``.

    transformers' generic fields at their defaults (``id2label``, ``return_dict``, ...: what
    ``config.to_dict()`` adds and ``save_pretrained`` leaves out) are left out, so that an export's
    config.json is the same whether it came from a module, a training run or a checkpoint.
    """
    qwen = to_qwen3_config(cfg)
    out = normalize_draft_config(qwen.to_diff_dict())
    for key in EXPORT_BACKBONE_KEYS:
        out.setdefault(key, getattr(qwen, key))
    out.setdefault("rope_parameters", dict(qwen.rope_parameters))
    if "rope_theta" in out["rope_parameters"]:
        out["rope_theta"] = out["rope_parameters"]["rope_theta"]
    if out.get("input_embedding_scale") == 1.0:
        del out["input_embedding_scale"]  # a no-op that SGLang would not read anyway
    out["torch_dtype"] = out["dtype"] = DTYPE_NAMES[dtype]
    return out


def strip_model_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contract names: drop the optional ``model.`` prefix that loaders tolerate."""
    return {name.removeprefix("model."): tensor for name, tensor in state.items()}


def _is_borrowed(name: str) -> bool:
    return any(part in BORROWED_NAMES for part in name.split("."))


def tensor_problems(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Missing, extra and misshapen tensors, one message each (names already without ``model.``)."""
    problems = []
    for name in sorted(set(shapes) - set(expected)):
        if _is_borrowed(name):
            problems.append(
                f"tensor {name} {list(shapes[name])}: the draft borrows embed_tokens/lm_head from the target; "
                "remove it"
            )
        elif name.removesuffix(".weight") in expected:
            problems.append(
                f"tensor {name} {list(shapes[name])}: must be saved as {name.removesuffix('.weight')} "
                "(no .weight suffix); servers drop the unknown name silently and load zeros"
            )
        else:
            problems.append(
                f"unexpected tensor {name} {list(shapes[name])}: servers drop unknown names silently; remove it"
            )
    for name in sorted(set(expected) - set(shapes)):
        problems.append(f"missing tensor {name}: expected shape {list(expected[name])}")
    for name in sorted(set(expected) & set(shapes)):
        if tuple(shapes[name]) != tuple(expected[name]):
            problems.append(
                f"tensor {name}: expected shape {list(expected[name])}, found {list(shapes[name])}"
            )
    return problems


def _expected_or_problem(cfg: dict, problems: list[str]) -> dict[str, tuple[int, ...]] | None:
    """Expected shapes, or None with a note when the config is too broken to derive them."""
    try:
        return expected_tensor_shapes(cfg)
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as error:
        problems.append(f"tensor names and shapes not checked until the config is fixed ({error!r})")
        return None


# ---------------------------------------------------------------------------------------------------------
# Checking an export directory
# ---------------------------------------------------------------------------------------------------------


def read_tensor_meta(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) from safetensors headers, without reading the data."""
    meta = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                dtype = tensor_slice.get_dtype()
                meta[name] = (tuple(tensor_slice.get_shape()), SAFETENSORS_DTYPES.get(dtype, dtype))
    return meta


def _dtype_problems(meta: dict[str, tuple[tuple[int, ...], str]], cfg: dict) -> list[str]:
    saved = sorted({dtype for _, dtype in meta.values()})
    if len(saved) > 1:
        return [f"tensors are saved in several dtypes {saved}; save all in one (bfloat16 by default)"]
    if not saved:
        return []
    if cfg.get("torch_dtype") is None and cfg.get("dtype") is None:
        return [f"torch_dtype and dtype are absent; set both to {saved[0]!r}, the dtype of the saved tensors"]
    return [
        f"{key}={cfg[key]!r} but the tensors are {saved[0]}; set {key} to {saved[0]!r}"
        for key in ("torch_dtype", "dtype")
        if cfg.get(key) is not None and cfg[key] != saved[0]
    ]


def check_export(path: str | Path, *, tokenizer: Any = None, target_config: Any = None) -> list[str]:
    """Every problem of an export directory (ours or a third party's); an empty list means servable.
    `tokenizer` (a tokenizer or its directory) and `target_config` (a config or its path) add the checks
    against the target."""
    path = Path(path)
    if holds_draft(path):
        return [
            f"{path} is a training checkpoint, not an export: write its export with "
            f"`python -m dflash2.export {path} <out>`, then check <out>"
        ]
    if not (path / CONFIG_NAME).is_file():
        return [f"{path}: no {CONFIG_NAME}; an export holds {CONFIG_NAME} and {WEIGHTS_NAME}"]
    try:
        cfg = load_config_dict(path)
    except json.JSONDecodeError as error:
        return [f"{path / CONFIG_NAME}: not valid JSON ({error})"]
    problems = validate_draft_config(
        cfg, tokenizer=tokenizer, target_config=target_config, source=path / CONFIG_NAME
    )
    files = weight_files(path)
    if not files:
        return problems + [f"{path}: no {WEIGHTS_NAME}; write the draft weights there"]
    meta = read_tensor_meta(files)
    names = [name for name in meta if name.startswith("model.")]
    if names and len(names) != len(meta):
        problems.append("some tensor names carry the model. prefix and some do not; use no prefix")
    meta = {name.removeprefix("model."): value for name, value in meta.items()}
    expected = _expected_or_problem(cfg, problems)
    if expected is not None:
        problems += tensor_problems({name: shape for name, (shape, _) in meta.items()}, expected)
    return problems + _dtype_problems(meta, cfg)


def summary(path: str | Path) -> str:
    """One line describing an export: architecture, layers, parameters, block size, dtype."""
    path = Path(path)
    cfg = load_config_dict(path)
    meta = read_tensor_meta(weight_files(path))
    num_params = sum(math.prod(shape) for shape, _ in meta.values())
    dtypes = sorted({dtype for _, dtype in meta.values()})
    return (
        f"{path}: {cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, "
        f"{num_params / 1e6:.2f} M params, block size {draft_value(cfg, 'block_size')}, {'/'.join(dtypes)}"
    )


# ---------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------


def _state_and_config(
    model_or_state: torch.nn.Module | dict[str, torch.Tensor], config: dict | str | Path | None
) -> tuple[dict[str, torch.Tensor], dict]:
    if isinstance(model_or_state, torch.nn.Module):
        state = model_or_state.state_dict()
        if config is None:
            config = model_or_state.config.to_dict()
    else:
        state = model_or_state
    if config is None:
        raise ValueError(
            "export_draft: a plain state dict needs config=<draft config dict or its config.json>"
        )
    return strip_model_prefix(state), load_config_dict(config)


# What an export directory holds: its config, its weights (one file, or an index and its shards)
# and the record of its training run. An existing out_dir with anything else is not replaced.
_SHARD_FILE = r"model-\d+-of-\d+\.safetensors"  # the shards an index names (save_pretrained's names)
EXPORT_FILE = re.compile(
    "|".join(
        [
            *(re.escape(name) for name in (CONFIG_NAME, TRAINING_RUN_NAME, WEIGHTS_NAME, INDEX_FILE)),
            _SHARD_FILE,
        ]
    )
)


def check_out_dir(out_dir: Path) -> None:
    """Refuse to replace a directory that is not an export (a run directory, a checkpoint: the export
    replaces its directory whole)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"out_dir {out_dir} is a file; give a directory for the export")
    others = sorted(p.name for p in out_dir.iterdir() if not EXPORT_FILE.fullmatch(p.name))
    if others:
        raise ValueError(
            f"out_dir {out_dir} holds more than an export ({', '.join(others[:4])}"
            f"{', ...' if len(others) > 4 else ''}), and an export replaces its directory whole: give a new "
            f"or empty directory, such as {out_dir / 'export'}"
        )


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished export into place; an old export there is replaced only after that succeeds,
    and put back if the move fails."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if old is not None:
            os.replace(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old)


def read_training_run(export_dir: str | Path) -> dict:
    """The export's record of its training run ({} when it has none)."""
    path = Path(export_dir) / TRAINING_RUN_NAME
    return json.loads(path.read_text()) if path.is_file() else {}


def export_draft(
    model_or_state: torch.nn.Module | dict[str, torch.Tensor],
    out_dir: str | Path,
    *,
    config: dict | str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer: Any = None,
    target_config: Any = None,
    training_run: dict | None = None,
    source: str | Path | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``out_dir`` atomically and validate what was written.

    model_or_state: a draft module (its ``.config`` a Qwen3Config with ``dflash_config``) or a state dict
    with contract names (an optional ``model.`` prefix is stripped), in which case ``config`` is required
    (a dict, or the config.json to read it from).
    training_run: written as ``training_run.json`` (e.g. {"step": 300, "chat_template_kwargs": {}}).
    source: the file ``config`` was read from, named in a draft/target mismatch.
    Raises ValueError listing every problem; nothing is left at ``out_dir`` when validation fails.
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype}: export in one of {list(DTYPE_NAMES)} (bfloat16 by default)")
    if source is None and isinstance(config, (str, Path)):
        source = config
    state, cfg = _state_and_config(model_or_state, config)
    borrowed = sorted(name for name in state if _is_borrowed(name))
    if borrowed:
        raise ValueError(
            f"tensors {borrowed} belong to the target (embed_tokens/lm_head); export the draft only"
        )
    cfg = export_config(cfg, dtype)
    problems = validate_draft_config(cfg, tokenizer=tokenizer, target_config=target_config, source=source)
    expected = _expected_or_problem(cfg, problems)
    if expected is not None:
        problems += tensor_problems({name: tuple(t.shape) for name, t in state.items()}, expected)
    if problems:
        raise ValueError("export refused:\n  " + "\n  ".join(problems))

    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for leftover in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # of an export that was killed
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    try:
        _write_export(tmp, state, cfg, dtype, training_run)
        problems = check_export(tmp, tokenizer=tokenizer, target_config=target_config)
        if problems:
            raise ValueError("export failed its own check:\n  " + "\n  ".join(problems))
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves nothing behind
    return out_dir


def _write_export(tmp: Path, state: dict, cfg: dict, dtype: torch.dtype, training_run: dict | None) -> None:
    tensors = {name: t.detach().to("cpu", dtype).clone().contiguous() for name, t in state.items()}
    save_tensors(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
    with open(tmp / CONFIG_NAME, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    if training_run is not None:
        (tmp / TRAINING_RUN_NAME).write_text(json.dumps(training_run, indent=2, sort_keys=True) + "\n")


def source_training_run(path: str | Path) -> dict | None:
    """What an export of `path` records of its training run: the step of a training checkpoint and
    its run's chat template arguments (contract.json), or the record of an export; None if neither."""
    path = Path(path)
    if holds_draft(path):
        record = {"step": read_train_state(path).step}
        contract = read_contract(path) if (path / CONTRACT).is_file() else {}
        if "chat_template_kwargs" in contract:
            record["chat_template_kwargs"] = contract["chat_template_kwargs"]
        return record
    return read_training_run(path) or None


def load_source(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, config dict) from a training checkpoint directory or a Hugging Face style model directory."""
    path = Path(path)
    if holds_draft(path):
        return read_draft(path)
    files = weight_files(path)
    if (path / CONFIG_NAME).is_file() and files:
        return load_weights(files), load_config_dict(path)
    raise ValueError(
        f"{path}: expected {DRAFT_CONFIG} + {DRAFT_WEIGHTS} (training checkpoint) "
        f"or {CONFIG_NAME} + {WEIGHTS_NAME} (model directory)"
    )


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dflash2.export", description=__doc__.split("\n")[0])
    parser.add_argument("source", nargs="?", help="training checkpoint dir or model dir to export")
    parser.add_argument("out_dir", nargs="?", help="export directory to write")
    parser.add_argument("--check", metavar="DIR", help="validate an export directory and exit")
    parser.add_argument("--dtype", choices=PRECISIONS, default="bf16")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer dir, to check the mask token")
    parser.add_argument("--target", metavar="DIR", help="target model dir (config.json), to check sizes")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.check is None and (args.source is None or args.out_dir is None):
        parser.error("give <source> <out_dir> to export, or --check <dir>")
    if args.check is not None and args.source is not None:
        parser.error("--check takes only the directory to check")
    for name, value, what in (
        ("source", args.source, "a training checkpoint directory or a model directory"),
        ("--check", args.check, "an export directory"),
        ("--tokenizer", args.tokenizer, "the target's local model directory"),
        ("--target", args.target, "the target's local model directory"),
    ):
        if value is not None:
            require_path(value, name, "dir", what)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer, "--tokenizer")
    target_config = args.target  # a path: a draft/target mismatch names its config.json
    if args.check is not None:
        path = Path(args.check)
    else:
        state, cfg = load_source(args.source)
        try:
            path = export_draft(
                state,
                args.out_dir,
                config=cfg,
                dtype=torch_dtype(args.dtype),
                tokenizer=tokenizer,
                target_config=target_config,
                training_run=source_training_run(args.source),
                source=Path(args.source) / (DRAFT_CONFIG if holds_draft(Path(args.source)) else CONFIG_NAME),
            )
        except ValueError as error:
            print(error, file=sys.stderr)
            return 1
    problems = check_export(path, tokenizer=tokenizer, target_config=target_config)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print(summary(path))
    return 0


if __name__ == "__main__":
    exit_process(run_main(main))
