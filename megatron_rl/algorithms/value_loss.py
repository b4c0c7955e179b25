"""Value (critic) losses — pure per-token tensor functions (PPO with GAE, ALGORITHMS.md §5).

Notation: V = the critic's value being trained (`values`, with grad); V_old = the value the same
critic predicted when the batch's advantages and returns were computed (`old_values`, no grad);
R = the regression target (`returns` = GAE advantages + V_old, before whitening); ε = value clip.

- `clipped` (PPO's value clipping): ℓ = ½·max((V − R)², (V_clip − R)²) with
  V_clip = V_old + clip(V − V_old, −ε, ε). Where the clipped term is strictly larger and V has left
  [V_old − ε, V_old + ε], V_clip is constant in V: that token's gradient is 0 (the trust region on
  the critic). Elsewhere the gradient is (V − R).
- `mse`: ℓ = ½·(V − R)² (no clipping; `old_values` and `clip_eps` are ignored).

Shapes: every tensor has the same shape, usually [B, T]; `response_mask` (bool, same shape,
optional) marks the valid tokens; invalid tokens get loss 0 and exactly zero gradient. Aggregation
over tokens is `aggregation.py`'s job (the critic uses token-mean by default).

Every loss returns `(loss, metrics)`: `loss` per token (same shape as `values`); `metrics` holds
`clipped` (bool: the clipped term was chosen, i.e. PPO's value clip fraction counts it).
"""

from __future__ import annotations

import torch

from .registry import register

Tensor = torch.Tensor


def _upcast(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _valid(response_mask: Tensor | None, like: Tensor) -> Tensor:
    if response_mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if response_mask.shape != like.shape:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}, "
                         f"values have {tuple(like.shape)}")
    return response_mask.bool()


def _clean(x: Tensor, valid: Tensor) -> Tensor:
    # torch.where: padding (possibly NaN or inf) reaches neither the loss nor the gradient.
    x = _upcast(x)
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


@register("value_loss", "clipped")
def clipped_value_loss(
    values: Tensor, returns: Tensor, *, old_values: Tensor | None = None, clip_eps: float = 0.2,
    response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """½·max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²) per token."""
    if old_values is None:
        raise ValueError("value loss 'clipped' needs old_values (the critic's values at rollout "
                         "time); use 'mse' for the unclipped loss")
    if not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0 (got {clip_eps}); use 'mse' for no clipping")
    valid = _valid(response_mask, values)
    v = _clean(values, valid)
    r, v_old = _clean(returns, valid).detach(), _clean(old_values, valid).detach()
    v_clip = v_old + (v - v_old).clamp(-clip_eps, clip_eps)
    unclipped, clipped = (v - r).square(), (v_clip - r).square()
    chosen = clipped > unclipped
    # torch.where, not torch.maximum: a tie means V_clip = V (V inside the clip range), where both
    # terms are the same function of V, so the unclipped branch carries the formula's gradient.
    loss = 0.5 * torch.where(chosen, clipped, unclipped)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return loss, {"clipped": chosen & valid}


@register("value_loss", "mse")
def mse_value_loss(
    values: Tensor, returns: Tensor, *, old_values: Tensor | None = None, clip_eps: float | None = None,
    response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """½·(V − R)² per token."""
    valid = _valid(response_mask, values)
    v, r = _clean(values, valid), _clean(returns, valid).detach()
    loss = torch.where(valid, 0.5 * (v - r).square(), torch.zeros_like(v))
    return loss, {"clipped": torch.zeros_like(valid)}
