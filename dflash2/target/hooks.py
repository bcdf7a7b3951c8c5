"""Hooks on a target's decoder layers: what `target_layer_ids` index, and their outputs.

The contract's feature of layer id k is the OUTPUT of decoder layer k (0-based), for every k in
0..L-1. Hugging Face's `output_hidden_states` does not give that for the last layer: its
`hidden_states[L]` is the final-normed state. So the outputs are read with forward hooks on the
decoder layers themselves, which also keeps only the K requested layers instead of all L + 1
hidden states. Hooks see plain activations, so they work the same on an unsharded model, under
ZeRO-3 and under FSDP2. With `last_hidden`, a hook on the decoder's final norm also catches the
final-normed last hidden state (the input of the LM head).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


def final_norm(model: nn.Module) -> nn.Module:
    """The text decoder's final norm: its output is the LM head's input."""
    norm = getattr(model.get_decoder(), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(
            f"{type(model).__name__}'s text decoder has no final `norm` module, whose output the KL / TV "
            "loss terms and the target's labels need; set objective.kl_weight=0, objective.tv_weight=0 "
            "and objective.labels=data for this target"
        )
    return norm


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM's text decoder (the language model of a vision-language
    checkpoint): what `target_layer_ids` index."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no text decoder with a `layers` list (model.get_decoder().layers); "
            "use a target of a supported family (docs/targets.md)"
        )
    return layers


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> None:
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"target_layer_ids {list(bad)} out of range for a target with {num_layers} decoder layers "
            f"(valid ids: 0..{num_layers - 1}); fix dflash_config.target_layer_ids in the draft config"
        )


class LayerOutputs:
    """What the hooks of `capture_layer_outputs` caught in the last forward."""

    def __init__(self, layer_ids: Sequence[int]) -> None:
        self.layer_ids = [int(i) for i in layer_ids]
        self.outputs: dict[int, torch.Tensor] = {}
        self.last_hidden: torch.Tensor | None = None

    def keep_last_hidden(self, module: nn.Module, args, output) -> None:
        self.last_hidden = output

    def hook(self, layer_id: int):
        def keep(module: nn.Module, args, output) -> None:
            # decoder layers return the hidden states, or a tuple starting with them
            self.outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return keep

    def features(self) -> torch.Tensor:
        """Outputs of layers `layer_ids`, concatenated in that order: [b, S, K*H], then the final-normed
        last hidden state when it was caught: [b, S, (K+1)*H]."""
        missing = [i for i in self.layer_ids if i not in self.outputs]
        assert not missing, f"no forward reached decoder layers {missing} inside capture_layer_outputs"
        last = [] if self.last_hidden is None else [self.last_hidden]
        return torch.cat([self.outputs[i] for i in self.layer_ids] + last, dim=-1)


@contextmanager
def capture_layer_outputs(
    model: nn.Module, layer_ids: Sequence[int], last_hidden: bool = False
) -> Iterator[LayerOutputs]:
    """Inside the block, each forward of `model` leaves the outputs of decoder layers `layer_ids`
    (and, with `last_hidden`, of the final norm) in the yielded LayerOutputs (`.features()` ->
    [b, S, K*H], or [b, S, (K+1)*H]). `model` is the module itself (a DeepSpeed engine's `.module`);
    FSDP2-sharded models are passed as they are."""
    layers = decoder_layers(model)
    check_layer_ids(layer_ids, len(layers))
    captured = LayerOutputs(layer_ids)
    handles = [layers[i].register_forward_hook(captured.hook(i)) for i in sorted(set(captured.layer_ids))]
    if last_hidden:
        handles.append(final_norm(model).register_forward_hook(captured.keep_last_hidden))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
