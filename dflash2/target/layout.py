"""Linear products laid out for decoding on a CPU (`dflash2.target.state.use_decoding_layout`).

A decode multiplies one row (a plain decoding step) or a few (a verify block of B tokens, the
draft's block) by weights read from memory. With the weight `[out, in]` as loaded, `F.linear` runs
MKL's transposed GEMM, which at a few rows is far from the cost of reading the weight once. Each
row count has its fast form (docs/benchmarks.md): one row `x @ weight_t` on a transposed copy
`[in, out]`, several `(weight @ x.T).T` on the weight as loaded, which reads each weight row once
for all of them. Both are kept, so a product costs twice the weight's memory.

The copy follows the weight: an in-place change of it (an optimizer step, `load_state_dict`) is
seen by its version counter and the copy is made again before the next product; with gradients
enabled on a trainable weight the product is `F.linear` itself, so training through a re-laid
module computes the same gradients as through `nn.Linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def decoding_product(
    x: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., in] -> [..., out] for weight [out, in] and its transposed copy weight_t [in, out]:
    the same values as `F.linear(x, weight, bias)` within fp32 rounding (other GEMM kernels)."""
    if x.numel() == x.shape[-1]:  # one row: a plain decoding step
        out = x @ weight_t
    else:
        out = (weight @ x.reshape(-1, x.shape[-1]).t()).t().contiguous().view(*x.shape[:-1], -1)
    return out if bias is None else out + bias


def weight_state(weight: torch.Tensor) -> tuple[int, int]:
    """What a transposed copy of `weight` was made from: its storage and its in-place version."""
    return weight.data_ptr(), weight._version


class DecodingLinear(nn.Module):
    """An `nn.Linear` laid out for decoding: the same weight parameter (tied where it was) and bias,
    plus a transposed copy of the weight (a buffer: the state dict is unchanged), made again when
    the weight changed in place."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("weight_t", None, persistent=False)
        self.copy_weight()

    def copy_weight(self) -> None:
        self.weight_t = self.weight.detach().t().contiguous()
        self.copied_from = weight_state(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # read once: a module attribute costs microseconds, 210 times a forward
        if torch.is_grad_enabled() and weight.requires_grad:  # training: autograd on the weight
            return F.linear(x, weight, self.bias)
        if self.copied_from != weight_state(weight):  # changed in place since the copy
            self.copy_weight()
        return decoding_product(x, weight, self.weight_t, self.bias)
