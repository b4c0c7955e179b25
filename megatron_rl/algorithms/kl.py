"""KL-to-reference estimators and the entropy bonus (ALGORITHMS.md §4).

Samples come from π; `logp` = log π(a_t) (with grad), `ref_logp` = log π_ref(a_t) (frozen).
With log ρ = log π_ref − log π:
- k1 = log π − log π_ref
- k2 = ½ (log π − log π_ref)²
- k3 ("low_var_kl") = ρ − log ρ − 1, log ρ clamped to ±20 and the value to ≤ 10 (as verl does;
  the clamps cut the gradient where they bind, which only happens for absurd ratios)
- k1+ / k3+: straight-through — the value of k1 / k3 with the gradient of k2
  (k2 − sg(k2) + sg(k)), an unbiased-gradient KL loss whose logged value is the chosen estimator.
Use as a loss term (`coef · k`, aggregated like the policy loss) or as a per-token reward penalty
(`kl_penalty_rewards`). Shapes: any, all equal.
"""

from __future__ import annotations

import torch

from .registry import get, register

Tensor = torch.Tensor

K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


@register("kl", "k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


@register("kl", "k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp).square()


@register("kl", "k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    log_rho = torch.clamp(ref_logp - logp, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_rho) - log_rho - 1.0, max=K3_VALUE_CLAMP)


register("kl", "low_var_kl")(kl_k3)


def _straight_through(value: Tensor, logp: Tensor, ref_logp: Tensor) -> Tensor:
    k2 = kl_k2(logp, ref_logp)
    return k2 - k2.detach() + value.detach()


@register("kl", "k1+")
def kl_k1_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return _straight_through(kl_k1(logp, ref_logp), logp, ref_logp)


@register("kl", "k3+")
def kl_k3_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return _straight_through(kl_k3(logp, ref_logp), logp, ref_logp)


def kl_penalty_rewards(
    token_rewards: Tensor, logp: Tensor, ref_logp: Tensor, *, coef: float,
    estimator: str = "k1", response_mask: Tensor | None = None,
) -> Tensor:
    """Per-token rewards minus coef·KL (no grad): the KL-in-reward form used with REINFORCE++/GAE.
    `logp` are the rollout (or recomputed old) log-probs of the sampled tokens."""
    kl = get("kl", estimator)(logp.detach(), ref_logp.detach())
    out = token_rewards - coef * kl
    if response_mask is not None:
        out = torch.where(response_mask.bool(), out, torch.zeros_like(out))
    return out


def entropy_bonus(entropy: Tensor, coef: float) -> Tensor:
    """Per-token loss term −coef·H (entropy from the vocab-parallel module, with grad)."""
    return -coef * entropy
