"""Start a draft from the target's own weights (`model.init_from_target`).

Draft layer i gets the weights of target decoder layer `ids[i]` (default: the target's last n
layers, in order): every parameter of that target layer must have a draft parameter of the same
name and shape (attention projections, MLP, the layer's norms), or nothing is copied and the error
names the first mismatch. Norm weights are carried by their effect, not their raw values: a target
norm is run on a vector of ones to read the scale it applies, so a `(1 + w)` norm gives the same
layer as a plain `w` one, and a module that is not an elementwise-scaled RMS norm is refused. The
draft's final norm takes the target's, and `fc` adds the identity on the deepest captured layer's
slice and `hidden_norm` the first copied layer's input norm, so at step 0 the draft's first layer
reads that captured layer's state as the target layer reads its input (its own input when it is the
layer after the deepest captured one). Draft parameters the target has no
counterpart for keep their initialisation (a Llama target has no q/k norms; DFlash 2's convs stay
the identity); the one-line summary says which.

Only the safetensors tensors of the chosen layers are read; the target is built on meta to find
their names. Run on the unsharded draft, before the backend wraps it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from dflash2.target.files import read_tensor, target_tensor_files
from dflash2.target.head import checkpoint_model

FIX = "set model.init_from_target: false to start the draft from a random initialisation"


def init_from_target(
    draft: nn.Module, target_dir: str | Path, target_config, layer_ids: list[int] | None = None
) -> str:
    """Copy the target's weights into `draft` in place; returns a one-line summary."""
    with torch.device("meta"):
        target = checkpoint_model(target_config)
    module_names = {id(m): name for name, m in target.named_modules()}
    target_layers = target.get_decoder().layers
    n = len(draft.layers)
    ids = list(range(len(target_layers) - n, len(target_layers))) if layer_ids is None else list(layer_ids)
    if layer_ids is None and n > len(target_layers):
        raise ValueError(
            f"the draft has {n} layers, the target {len(target_layers)}: give model.init_target_layers {n} target "
            f"layer ids (repeats allowed), or {FIX}"
        )
    if len(ids) != n or not all(0 <= i < len(target_layers) for i in ids):
        raise ValueError(
            f"model.init_target_layers={ids} must name {n} target layer(s) (one per draft layer), each in "
            f"0..{len(target_layers) - 1}; or {FIX}"
        )
    copies: list[tuple[nn.Module, str, nn.Module, str]] = []  # (draft module, param, target module, name)
    for i, t in zip(range(n), ids):
        copies += _layer_copies(draft.layers[i], target_layers[t], t, module_names)
    decoder_norm = target.get_decoder().norm
    copies.append((draft.norm, "weight", decoder_norm, f"{module_names[id(decoder_norm)]}.weight"))
    first_norm = getattr(target_layers[ids[0]], "input_layernorm", None)  # draft layer 0 reads the context
    if first_norm is None:  # as target layer ids[0] reads its input
        raise ValueError(f"target layer {ids[0]} has no input_layernorm; {FIX}")
    copies.append((draft.hidden_norm, "weight", first_norm, f"{module_names[id(first_norm)]}.weight"))

    files = target_tensor_files(target_dir)
    missing = [name for *_, name in copies if name not in files]
    if missing:
        raise ValueError(f"{target_dir}: no tensor {missing[0]!r} in the checkpoint; {FIX}")
    values = []  # every value checked before any is copied: a refusal leaves the draft as it was
    for module, _, source, name in copies:
        value = read_tensor(files, name).float()
        values.append(_norm_scale(source, value, module, name) if _is_norm(module) else value)
    with torch.no_grad():
        for (module, param, *_), value in zip(copies, values):
            getattr(module, param).copy_(value)
        deepest = draft.target_layer_ids.index(max(draft.target_layer_ids))
        hidden = draft.fc.weight.shape[0]
        draft.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] += torch.eye(hidden)

    copied = set().union(*(_copied_names(copies, layer) for layer in draft.layers))
    kept = {name.rpartition(".")[0] for name, _ in draft.layers[0].named_parameters()} - copied
    kept = sorted(name for name in kept if name.rpartition(".")[0] not in kept)  # a module, not its parts
    layers = ", ".join(f"{t} -> {i}" for i, t in enumerate(ids))
    return (
        f"draft initialised from the target: layers {layers}, the final norm, fc reading target layer "
        f"{max(draft.target_layer_ids)} through layer {ids[0]}'s input norm"
        + (f"; kept their initialisation: {', '.join(kept)}" if kept else "")
        + _rope_note(draft, target_config)
    )


def _layer_copies(draft_layer: nn.Module, target_layer: nn.Module, index: int, module_names: dict) -> list:
    draft_params = dict(draft_layer.named_parameters())
    prefix = module_names[id(target_layer)]
    copies = []
    for name, param in target_layer.named_parameters():
        mine = draft_params.get(name)
        if mine is None or mine.shape != param.shape:
            have = "no such parameter" if mine is None else f"shape {list(mine.shape)}"
            raise ValueError(
                f"target layer {index}'s {name} {list(param.shape)} has no counterpart in the draft's "
                f"layers ({have}): this target's layers are not the draft's kind; {FIX}"
            )
        module_name, _, param_name = name.rpartition(".")
        copies.append(
            (
                draft_layer.get_submodule(module_name),
                param_name,
                target_layer.get_submodule(module_name),
                f"{prefix}.{name}",
            )
        )
    return copies


def _copied_names(copies: list, layer: nn.Module) -> set[str]:
    """Names (within `layer`) of the modules of `layer` that `copies` writes."""
    names = {id(m): name for name, m in layer.named_modules()}
    return {names[id(module)] for module, *_ in copies if id(module) in names}


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def _norm_scale(source: nn.Module, weight: torch.Tensor, draft_norm: nn.Module, name: str) -> torch.Tensor:
    """The elementwise scale target norm `source` applies with `weight`, as `draft_norm`'s weight;
    refused unless the draft norm with it computes what the target norm computes."""
    norm = copy.deepcopy(source).to_empty(device="cpu").float()
    probe = copy.deepcopy(draft_norm).cpu().float()
    with torch.no_grad():
        norm.weight.copy_(weight)
        probe.weight.fill_(1.0)
        ones = torch.ones(1, weight.shape[-1])
        scale = norm(ones)[0] / probe(ones)[0]
        probe.weight.copy_(scale)
        x = torch.randn(4, weight.shape[-1], generator=torch.Generator().manual_seed(0)) * 3
        if not torch.allclose(probe(x), norm(x), rtol=1e-3, atol=1e-4):
            raise ValueError(
                f"{name}: the target's {type(source).__name__} is not an RMS norm with a scale; {FIX}"
            )
    return scale


def _rope_note(draft: nn.Module, target_config) -> str:
    """A warning when the copied attention layers will rotate under another RoPE than the target's."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    theirs, ours = (
        getattr(text, "rope_parameters", None) or {},
        getattr(draft.config, "rope_parameters", None) or {},
    )
    keys = ("rope_type", "rope_theta")
    if all(theirs.get(k) == ours.get(k) for k in keys):
        return ""
    show = lambda p: ", ".join(f"{k} {p.get(k)}" for k in keys)  # noqa: E731
    return (
        f"; note: the draft's RoPE ({show(ours)}) is not the target's ({show(theirs)}): its copied attention "
        "layers start under another rotation (set the draft config's rope_theta to the target's)"
    )
