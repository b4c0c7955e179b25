"""Small tensor collectives shared by the data path and the algorithms (no pickles)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_varlen(x: torch.Tensor, group, device) -> list[torch.Tensor]:
    """Every rank's 1-D `x` (lengths may differ), in group-rank order, on the host. Two all-gathers:
    the lengths, then the values padded to the longest."""
    n = torch.tensor([x.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    m = max(int(s) for s in sizes)
    padded = torch.zeros(m, dtype=x.dtype, device=device)
    padded[:x.numel()] = x.to(device)
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=group)
    return [o[:int(s)].cpu() for o, s in zip(out, sizes)]


def all_reduce_sum(x: torch.Tensor, group, device) -> torch.Tensor:
    """Sum of `x` over `group` (returned on x's device)."""
    y = x.to(device).clone()
    dist.all_reduce(y, group=group)
    return y.to(x.device)
