"""Rollout/training mismatch corrections (ALGORITHMS.md §3) — used when π_old is recomputed.

ρ = π_old(a_t)/μ(a_t): the trainer's recomputed probability over the rollout engine's.
- TIS: weight sg(min(ρ, C)), C = 2 (`cap`).
- IcePop / MIS: weight ρ kept only inside [α, β] = [0.5, 5], 0 outside (the token is dropped).
`level="token"` uses the per-token ρ; `level="sequence"` uses ρ_i = exp(Σ_t log ρ_t) over the valid
tokens of sequence i (inputs [B, T]), broadcast to its tokens.

Each returns `(weight, metrics)`: `weight` (detached, same shape, 0 on invalid tokens) multiplies
the per-token policy loss; metrics are per-token tensors `ratio` (ρ), `masked` (dropped) and
`clipped` (capped). The health metric mean |log π_old − log μ| is logged by `diagnostics.py`.
"""

from __future__ import annotations

import torch

from .registry import register

Tensor = torch.Tensor

LOG_RATIO_CLAMP = 20.0
LEVELS = ("token", "sequence")


def _log_rho(old_logp: Tensor, rollout_logp: Tensor, level: str, response_mask: Tensor | None):
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(LEVELS)}")
    valid = torch.ones_like(old_logp, dtype=torch.bool) if response_mask is None else response_mask.bool()
    lr = (old_logp.detach().double() - rollout_logp.detach().double())
    lr = torch.where(valid, lr, torch.zeros_like(lr))
    if level == "sequence":
        if lr.dim() != 2:
            raise ValueError(f"sequence-level correction needs [B, T] inputs (got {tuple(lr.shape)})")
        lr = lr.sum(dim=-1, keepdim=True).expand_as(lr)
    return lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).to(old_logp.dtype), valid


@register("correction", "tis")
@torch.no_grad()
def tis_weight(
    old_logp: Tensor, rollout_logp: Tensor, *, cap: float = 2.0, level: str = "token",
    response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling: weight min(π_old/μ, C)."""
    lr, valid = _log_rho(old_logp, rollout_logp, level, response_mask)
    rho = torch.exp(lr)
    w = rho.clamp(max=cap)
    zero = torch.zeros_like(rho)
    return torch.where(valid, w, zero), {
        "ratio": torch.where(valid, rho, zero),
        "masked": torch.zeros_like(valid),
        "clipped": valid & (rho > cap),
    }


@register("correction", "icepop")
@torch.no_grad()
def icepop_weight(
    old_logp: Tensor, rollout_logp: Tensor, *, low: float = 0.5, high: float = 5.0,
    level: str = "token", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop / MIS: weight π_old/μ inside [low, high], 0 outside."""
    lr, valid = _log_rho(old_logp, rollout_logp, level, response_mask)
    rho = torch.exp(lr)
    keep = (rho >= low) & (rho <= high)
    zero = torch.zeros_like(rho)
    return torch.where(valid & keep, rho, zero), {
        "ratio": torch.where(valid, rho, zero),
        "masked": valid & ~keep,
        "clipped": torch.zeros_like(valid),
    }
