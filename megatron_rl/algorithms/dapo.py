"""DAPO pieces (ALGORITHMS.md §7): dynamic-sampling group filter and overlong reward shaping.

- `dynamic_sampling_keep`: drop prompt groups whose rewards are all equal (their group-relative
  advantage is 0 for every sample, so they carry no gradient). The rollout loop keeps generating
  until enough groups survive (bounded extra rounds); this function is only the pure filter.
- `overlong_soft_punishment`: 0 for |y| ≤ L_max − L_buf; ((L_max − L_buf) − |y|)/L_buf · f inside
  the buffer (L_max − L_buf < |y| ≤ L_max), falling linearly from 0 to −f; −f beyond L_max (the
  DAPO paper's value for over-long samples). Added to the outcome reward.
- `overlong_filter_mask`: zero the response mask of truncated samples (overlong filtering).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def dynamic_sampling_keep(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """Bool [B]: True for samples whose group has at least two distinct rewards."""
    if rewards_B.shape != group_ids_B.shape:
        raise ValueError(f"rewards {tuple(rewards_B.shape)} and group_ids {tuple(group_ids_B.shape)} differ")
    if rewards_B.numel() == 0:
        return torch.zeros_like(rewards_B, dtype=torch.bool)
    _, inv = torch.unique(group_ids_B, return_inverse=True)
    G = int(inv.max()) + 1
    r = rewards_B.to(torch.float64)
    gmax = torch.full((G,), -torch.inf, dtype=r.dtype).scatter_reduce(0, inv, r, reduce="amax")
    gmin = torch.full((G,), torch.inf, dtype=r.dtype).scatter_reduce(0, inv, r, reduce="amin")
    return (gmax > gmin)[inv]


def overlong_soft_punishment(lengths_B: Tensor, *, max_length: int, buffer_length: int,
                             factor: float = 1.0) -> Tensor:
    """Penalty (≤ 0, float [B]) to add to the outcome reward of responses of length |y|."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"need 0 < buffer_length <= max_length (got {buffer_length}, {max_length})")
    y = lengths_B.to(torch.float64)
    start = max_length - buffer_length
    pen = ((start - y) / buffer_length * factor).clamp(max=0.0)
    return torch.where(y > max_length, torch.full_like(y, -factor), pen)


def overlong_filter_mask(response_mask_BT: Tensor, truncated_B: Tensor) -> Tensor:
    """The response mask with every token of truncated samples (finish_reason == length) off."""
    return response_mask_BT.bool() & ~truncated_B.bool()[:, None]
