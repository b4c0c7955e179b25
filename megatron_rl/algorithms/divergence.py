"""Sampled-token ("binary") divergences between the anchor policy and π, from log-probs alone.

The binary approximation of DPPO collapses the vocabulary to {a_t, everything else}; it needs only
the two probabilities of the sampled token, so the loss library can compute it as a convenience.
Top-K and full-vocabulary divergences need the logits and live in `megatron_rl.vocab_parallel`;
the policy losses take their values as an input.

Shapes: any; `mu_logp` = log μ(a_t) (the anchor: rollout μ, or recomputed π_old), `pi_logp` =
log π(a_t). The argument order (μ first) matches `megatron_rl.vocab_parallel.divergences`.
Both divergences are computed without gradient (they only gate the update), in at least float32.
"""

from __future__ import annotations

import torch

from .registry import register

# Guard for 1 − p when p → 1 (a dominant token): keeps log(1 − p) finite.
ONE_MINUS_P_EPS = 1e-12


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


@register("divergence", "binary_tv")
@torch.no_grad()
def binary_tv(mu_logp: torch.Tensor, pi_logp: torch.Tensor) -> torch.Tensor:
    """Binary total variation |μ(a_t) − π(a_t)|."""
    return (torch.exp(_upcast(mu_logp)) - torch.exp(_upcast(pi_logp))).abs()


@register("divergence", "binary_kl")
@torch.no_grad()
def binary_kl(mu_logp: torch.Tensor, pi_logp: torch.Tensor, eps: float = ONE_MINUS_P_EPS) -> torch.Tensor:
    """Binary KL(μ‖π) = μ log(μ/π) + (1−μ) log((1−μ)/(1−π)) at the sampled token.

    1 − p is computed as −expm1(log p) (no cancellation as p → 1) and clamped to ≥ eps inside the
    logarithms only (μ = 1 then contributes exactly 0 from the rest cell). The result is clamped to ≥ 0 because rounding can make a KL near 0 slightly negative.
    """
    logp = _upcast(pi_logp.detach())
    anchor = _upcast(mu_logp.detach())
    mu = torch.exp(anchor)
    rest_mu = -torch.expm1(anchor)
    log_rest_mu = torch.log(rest_mu.clamp_min(eps))
    log_rest_pi = torch.log((-torch.expm1(logp)).clamp_min(eps))
    kl = mu * (anchor - logp) + rest_mu * (log_rest_mu - log_rest_pi)
    return kl.clamp_min(0.0)
