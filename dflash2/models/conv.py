"""DFlash 2 grouped dynamic depthwise convolution (contract section 2.1)."""

from __future__ import annotations

import torch
from torch import nn

BEFORE, AFTER = 0, 1  # the two sides of the wrapped sublayer


class GroupedDynamicConv(nn.Module):
    """Causal depthwise convolution along each block, with per-token kernels.

    `conv(z, side, c)[i, ch] = sum_t (base[side, t, ch] + c[i, side, t, ch // group_size]) * z[i - t, ch]`,
    with `z[i - t] = 0` before the start of i's block. Blocks live on their own axis ([..., B, H]),
    so the zero padding is per block by construction: nothing crosses a block boundary and nothing
    reaches the context.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} must divide hidden_size={hidden_size}")
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """Identity init: tap 0 = 1, other taps 0, no dynamic part. A fresh DFlash 2 layer equals v1."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def dynamic_kernels(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., B, H] -> dynamic kernel offsets [..., B, side=2, tap=T, group=G]."""
        return self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.num_groups))

    def forward(self, z: torch.Tensor, dynamic: torch.Tensor, side: int) -> torch.Tensor:
        """z [..., B, H] (block axis second to last); dynamic from `dynamic_kernels` of the sublayer input."""
        block_size = z.shape[-2]
        out = torch.zeros_like(z)
        for tap in range(min(self.kernel_size, block_size)):
            # z shifted down by `tap` slots inside each block, zeros entering at the block start.
            shifted = z if tap == 0 else torch.nn.functional.pad(z[..., :-tap, :], (0, 0, tap, 0))
            per_token = dynamic[..., side, tap, :].repeat_interleave(self.group_size, dim=-1)  # [..., B, H]
            out = out + (self.base_kernel[side, tap].to(z.dtype) + per_token) * shifted
        return out
