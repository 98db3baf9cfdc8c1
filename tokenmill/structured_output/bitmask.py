"""Token bitmasks: one int32 word per 32 tokens, bit set = token allowed (the layout xgrammar and llguidance
share), applied to rows of the logits."""

from __future__ import annotations

import torch

from tokenmill import kernels

_BITS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask forbids, for logits rows `rows` (bitmask row i
    goes with logits row rows[i])."""
    if kernels.token_bitmask_supported(logits):
        kernels.apply_token_bitmask(logits, rows, bitmask)
        return
    from tokenmill.kernels import triton_ops

    if logits.device.type == "cuda" and triton_ops.triton_usable(logits.device):
        triton_ops.apply_token_bitmask(logits, rows, bitmask)
        return
    vocab = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
