"""The target's embedding and LM head read straight from its safetensors, without loading the target.

Used wherever the draft trains without running the target itself: from offline features, and on
the trainer ranks of the disaggregated topology.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from dflash2.hf_weights import target_tensor_files
from dflash2.models.target_head import TargetHead, head_modules


def target_num_parameters(target_dir: str | Path) -> int:
    """Elements of all tensors in the target's checkpoint, read from the safetensors headers only."""
    total = 0
    files = target_tensor_files(target_dir)
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += torch.Size(f.get_slice(name).get_shape()).numel()
    return total


def _checkpoint_model(config) -> torch.nn.Module:
    """The class that wrote the checkpoint (config.architectures), so its module names are the
    checkpoint's tensor names: a vision-language checkpoint keeps its text decoder under
    `model.language_model.*`, which AutoModelForCausalLM renames only while loading."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if len(architectures) == 1 else None
    if model_class is None:
        return transformers.AutoModelForCausalLM.from_config(config)
    return model_class(config)


def _head_tensor_names(target_dir: str | Path) -> tuple[str, str, bool]:
    """(embedding weight name, LM head module name, tied) from the target's class, built on meta."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    with torch.device("meta"):  # no memory: only the module names are wanted
        model = _checkpoint_model(config)
    module_names = {id(module): name for name, module in model.named_modules()}
    embed, head = head_modules(model)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    return f"{module_names[id(embed)]}.weight", module_names[id(head)], tied


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_target_head(
    target_dir: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> TargetHead:
    """Read only the embedding [V, H] and the LM head [V, H] (+ bias) of a Hugging Face causal LM.

    Tied embeddings (no LM head tensor in the checkpoint, `tie_word_embeddings`) reuse the embedding.
    """
    files = target_tensor_files(target_dir)
    embed_name, head_name, tied = _head_tensor_names(target_dir)
    if embed_name not in files:
        raise ValueError(
            f"{target_dir}: no tensor {embed_name!r} in the checkpoint (it holds e.g. {sorted(files)[:4]}); "
            "the checkpoint's tensor names do not match its model class"
        )
    embed = _read(files, embed_name)
    head_weight_name = f"{head_name}.weight"
    if head_weight_name in files:
        head = _read(files, head_weight_name)
    elif tied:
        head = embed
    else:
        raise ValueError(
            f"{target_dir}: no LM head tensor {head_weight_name!r} and tie_word_embeddings is false; "
            "the checkpoint is incomplete"
        )
    bias_name = f"{head_name}.bias"
    bias = _read(files, bias_name) if bias_name in files else None
    as_head = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return TargetHead(as_head(embed), as_head(head), as_head(bias))
