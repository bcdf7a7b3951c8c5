"""Linear products laid out for decoding on a CPU (`dflash2.target.state.use_decoding_layout`).

A decode multiplies one row (a plain decoding step) or a few (a verify block of B tokens, the
draft's block) by weights read from memory. With the weight `[out, in]` as loaded, `F.linear` runs
MKL's transposed GEMM, which at a few rows is far from the cost of reading the weight once. Each
row count has its fast form (docs/benchmarks.md): one row `x @ weight_t` on a transposed copy
`[in, out]`, several `(weight @ x.T).T` on the weight as loaded, which reads each weight row once
for all of them. Both are kept, so a product costs twice the weight's memory.
"""

from __future__ import annotations

import torch
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


class DecodingLinear(nn.Module):
    """An `nn.Linear` laid out for decoding: the same weight parameter (tied where it was) and bias,
    plus a transposed copy of the weight (a buffer: the state dict is unchanged)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decoding_product(x, self.weight, self.weight_t, self.bias)
