"""The target's embedding table and LM head, borrowed (frozen) by the draft, tied or not.

`load_target_head` reads them straight from the safetensors, without loading the target: used wherever
the draft trains without running the target itself (from offline features, and on the trainer ranks
of the disaggregated topology).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from dflash2.target.files import read_tensor, target_tensor_files
from dflash2.target.layout import decoding_product, weight_state


def head_modules(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(input embedding, LM head) modules of a Hugging Face causal LM (sharded or not)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(
            f"{type(model).__name__} has no output embeddings (LM head); model.target must be a causal LM "
            "(a *ForCausalLM or *ForConditionalGeneration checkpoint)"
        )
    return model.get_input_embeddings(), head


def head_tensors(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(embedding weight [V, H], LM head weight [V, H], LM head bias [V] or None) of a causal LM."""
    embed, head = head_modules(model)
    return embed.weight, head.weight, getattr(head, "bias", None)


class TargetHead(nn.Module):
    """Frozen copies of the target's input embedding [V, H] and LM head [V, H] (+ optional bias).

    Held as buffers so that no optimizer or sharding wrapper ever treats them as trainable.
    """

    def __init__(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        lm_head_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if embed_weight.shape[1] != lm_head_weight.shape[1]:
            raise ValueError(
                f"target embedding width {embed_weight.shape[1]} != LM head width {lm_head_weight.shape[1]}"
            )
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        bias = None if lm_head_bias is None else lm_head_bias.detach()
        self.register_buffer("lm_head_bias", bias, persistent=False)
        # [H, V], set for decoding on a CPU only (use_decoding_layout; dflash2.target.layout)
        self.register_buffer("lm_head_weight_t", None, persistent=False)
        self.head_copied_from: tuple[int, int] | None = None  # weight_state of that copy's source
        self.loss_vocab: LossVocab | None = None  # restrict_loss_vocab

    def transpose_lm_head(self) -> None:
        """Keep a transposed copy of the LM head for one-row products (use_decoding_layout)."""
        self.lm_head_weight_t = self.lm_head_weight.t().contiguous()
        self.head_copied_from = weight_state(self.lm_head_weight)

    def restrict_loss_vocab(self, token_ids: torch.Tensor) -> None:
        """Compute the training loss over these token ids only (objective.loss_vocab_size); serving
        and evaluation keep the whole head."""
        self.loss_vocab = LossVocab(token_ids.to(self.lm_head_weight.device), self)

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head_weight.shape[1]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V]. As one 2-D product: a slice such as a block's slots
        [b, B-1, H] keeps its parent's strides, on which a bf16 product on a CPU leaves the fast
        kernel (50 ms instead of 2 ms for 3 rows of SmolLM2's head, docs/benchmarks.md)."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        if self.lm_head_weight_t is not None and rows.dtype == self.lm_head_weight.dtype:
            if self.head_copied_from != weight_state(self.lm_head_weight):  # changed in place since
                self.transpose_lm_head()
            logits = decoding_product(rows, self.lm_head_weight, self.lm_head_weight_t, self.lm_head_bias)
        else:
            logits = F.linear(rows, self.lm_head_weight.to(hidden.dtype), self.lm_head_bias)
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    @classmethod
    def from_target(cls, target: nn.Module, dtype: torch.dtype | None = None) -> TargetHead:
        """Copy the embedding and LM head out of an unsharded Hugging Face causal LM."""
        embed, weight, bias = head_tensors(target)
        cast = (lambda t: t.detach().clone().to(dtype)) if dtype else (lambda t: t.detach().clone())
        return cls(cast(embed), cast(weight), None if bias is None else cast(bias))


class LossVocab(nn.Module):
    """The tokens the loss is computed over (objective.loss_vocab_size): their ids [K] (sorted), their
    rows of the LM head, and each vocabulary id's index among them ([V], -1 for the others)."""

    def __init__(self, token_ids: torch.Tensor, head: TargetHead) -> None:
        super().__init__()
        ids = torch.unique(token_ids.long())  # sorted, distinct
        if len(ids) == 0 or int(ids[0]) < 0 or int(ids[-1]) >= head.vocab_size:
            raise ValueError(f"loss vocabulary ids must lie in [0, {head.vocab_size}); got {len(ids)} ids")
        index = torch.full((head.vocab_size,), -1, dtype=torch.long, device=ids.device)
        index[ids] = torch.arange(len(ids), device=ids.device)
        bias = None if head.lm_head_bias is None else head.lm_head_bias[ids]
        self.register_buffer("token_ids", ids, persistent=False)
        self.register_buffer("index", index, persistent=False)
        # A head of the K rows: the loss's matmuls and softmax run over K instead of V.
        self.head = TargetHead(head.embed_weight, head.lm_head_weight[ids].contiguous(), bias)

    def contains(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.index[token_ids] >= 0


def loss_vocabulary(labels: Iterable[torch.Tensor], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` token ids most frequent among `labels` (1-D tensors of supervised token ids), ties
    broken by the lower id; fewer when fewer distinct tokens occur."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in labels:
        counts += torch.bincount(ids.long(), minlength=vocab_size)
    order = torch.argsort(-counts, stable=True)  # most frequent first, lower id first among equals
    return order[: min(size, int((counts > 0).sum()))].sort().values


def target_num_parameters(target_dir: str | Path) -> int:
    """Elements of all tensors in the target's checkpoint, read from the safetensors headers only."""
    total = 0
    files = target_tensor_files(target_dir)
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += torch.Size(f.get_slice(name).get_shape()).numel()
    return total


def checkpoint_model(config) -> torch.nn.Module:
    """The class that wrote the checkpoint (config.architectures), so its module names are the
    checkpoint's tensor names: a vision-language checkpoint keeps its text decoder under
    `model.language_model.*`, which AutoModelForCausalLM renames only while loading."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if len(architectures) == 1 else None
    if model_class is None:
        return transformers.AutoModelForCausalLM.from_config(config)
    return model_class(config)


def _head_tensor_names(target_dir: str | Path, config=None) -> tuple[str, str, bool]:
    """(embedding weight name, LM head module name, tied) from the target's class, built on meta.
    `config`: the target's config when already read (default: read from `target_dir`)."""
    from transformers import AutoConfig

    config = config or AutoConfig.from_pretrained(target_dir)
    with torch.device("meta"):  # no memory: only the module names are wanted
        model = checkpoint_model(config)
    module_names = {id(module): name for name, module in model.named_modules()}
    embed, head = head_modules(model)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    return f"{module_names[id(embed)]}.weight", module_names[id(head)], tied


def load_target_head(
    target_dir: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu", config=None
) -> TargetHead:
    """Read only the embedding [V, H] and the LM head [V, H] (+ bias) of a Hugging Face causal LM.

    Tied embeddings (no LM head tensor in the checkpoint, `tie_word_embeddings`) reuse the embedding.
    `config`: the target's config when the caller has read it (default: read from `target_dir`).
    """
    files = target_tensor_files(target_dir)
    embed_name, head_name, tied = _head_tensor_names(target_dir, config)
    if embed_name not in files:
        raise ValueError(
            f"{target_dir}: no tensor {embed_name!r} in the checkpoint (it holds e.g. {sorted(files)[:4]}); "
            "the checkpoint's tensor names do not match its model class"
        )
    embed = read_tensor(files, embed_name)
    head_weight_name = f"{head_name}.weight"
    if head_weight_name in files:
        head = read_tensor(files, head_weight_name)
    elif tied:
        head = embed
    else:
        raise ValueError(
            f"{target_dir}: no LM head tensor {head_weight_name!r} and tie_word_embeddings is false; "
            "the checkpoint is incomplete"
        )
    bias_name = f"{head_name}.bias"
    bias = read_tensor(files, bias_name) if bias_name in files else None
    as_head = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return TargetHead(as_head(embed), as_head(head), as_head(bias))
