"""Sampled-token ("binary") divergences between the anchor policy and π, registered for the losses.

The binary approximation of DPPO collapses the vocabulary to {a_t, everything else}; it needs only
the two probabilities of the sampled token, so a policy loss can compute it from log-probs alone.
The one implementation lives in `megatron_rl.vocab_parallel.divergences` (pure tensor functions;
the top-K and full-vocabulary divergences there need the logits); here it is registered by name
and wrapped in no_grad, because divergences only gate the update.

Shapes: any; `mu_logp` = log μ(a_t) (the anchor: rollout μ, or recomputed π_old), `pi_logp` =
log π(a_t); at least float32.
"""

from __future__ import annotations

import torch

from megatron_rl.vocab_parallel import divergences as _vp

from .registry import register

ONE_MINUS_P_EPS = _vp.BINARY_EPS


@register("divergence", "binary_tv")
@torch.no_grad()
def binary_tv(mu_logp: torch.Tensor, pi_logp: torch.Tensor) -> torch.Tensor:
    """Binary total variation |μ(a_t) − π(a_t)|."""
    return _vp.binary_tv(mu_logp.detach(), pi_logp.detach())


@register("divergence", "binary_kl")
@torch.no_grad()
def binary_kl(mu_logp: torch.Tensor, pi_logp: torch.Tensor, eps: float = ONE_MINUS_P_EPS) -> torch.Tensor:
    """Binary KL(μ‖π) = μ log(μ/π) + (1−μ) log((1−μ)/(1−π)) at the sampled token (1 − p via
    log1mexp, floored at eps inside the logarithms; clamped ≥ 0)."""
    return _vp.binary_kl(mu_logp.detach(), pi_logp.detach(), eps)
