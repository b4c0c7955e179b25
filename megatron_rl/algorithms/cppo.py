"""CPPO: DPPO's divergence mask with a position-weighted threshold and a cumulative prefix budget
(Mao, Zhou, Tao et al., arXiv 2606.10968; ALGORITHMS.md §12).

Same divergence D_t as DPPO (binary / top-K TV or KL between the anchor μ and π; the top-K values
come from `megatron_rl.vocab_parallel`, exact across tensor-parallel shards), same advantage-sign
condition, same loss for the kept tokens; only the keep rule changes. Per response, over its valid
tokens at positions t = 1..T (a token inside the response that takes no loss, e.g. a tool's output,
keeps its position but has weight 0 and is left out of every sum and of the quantile):

    w_t = 1 − (1 − w_min)·(t − 1)/max(T − 1, 1)     (w_min past a fixed horizon T),  Z_t = w_t·D_t
    S_t = Σ_{j≤t} Z_j,  W_t = Σ_{j≤t} w_j          (over every valid token: kept, masked or not)
    c_t = min(δ, δ + δ_b·W_{t−1} − S_{t−1})           (may be negative)
    M_t = 1[A_t·(ρ_t − 1) ≤ 0  ∨  Z_t ≤ c_t]          (ties kept)

So an early drift spends the budget and masks later tokens that pass the token test alone, and a
late token with D slightly above δ is kept by w_t < 1. δ_b is fixed, or calibrated per response as
clamp(P_q(D over its valid tokens), δ_b, m·δ_b) (Eq. 22: q 0.9, m 2; the authors' later code used
m 5). With w_min = 1, δ_b = ∞ and no calibration the mask is DPPO's.

Layout: the last dimension is a sequence's positions, in order; one response per row (the
learner's micro-batches never split or pack responses). A response starts at its row's first valid
token: the learner's rows hold the prompt (no loss) and then the response, whose first token is
always the model's own. If responses are ever split across micro-batches or ranks (context
parallelism, packing), the running sums (S, W), the response's start and length and, for
calibration, its divergences must travel with the pieces.
"""

from __future__ import annotations

import math

import torch

from .policy_losses import (_finish, _prepare, _valid, divergence_and_delta, log_ratio, masked_truncated_loss,
                            select_anchor)
from .registry import register

Tensor = torch.Tensor

_F = torch.float64  # the scans: a 16k-token prefix sum in float32 drifts by ~1e-5, near the thresholds


def positions(scan: Tensor) -> tuple[Tensor, Tensor]:
    """(t, T): each token's 1-based position in its row's response (from the row's first `scan`
    token) and the response's length (first to last `scan` token), int64, [..., S] and [..., 1].
    Rows without a valid token get T = 1."""
    S = scan.shape[-1]
    idx = torch.arange(S, device=scan.device)
    any_ = scan.any(dim=-1, keepdim=True)
    first = torch.argmax(scan.to(torch.int8), dim=-1, keepdim=True)
    last = S - 1 - torch.argmax(scan.flip(-1).to(torch.int8), dim=-1, keepdim=True)
    t = idx - first + 1
    length = torch.where(any_, last - first + 1, torch.ones_like(first))
    return t, length


def position_weights(t: Tensor, horizon: Tensor | int, w_min: float) -> Tensor:
    """w_t = 1 − (1 − w_min)·(t − 1)/max(T − 1, 1), at least w_min (Eq. 9), float64."""
    denom = torch.clamp(torch.as_tensor(horizon, device=t.device) - 1, min=1).to(_F)
    w = 1.0 - (1.0 - w_min) * (t.to(_F) - 1.0) / denom
    return torch.clamp(w, min=w_min, max=1.0)


def row_quantile(x: Tensor, valid: Tensor, q: float) -> tuple[Tensor, Tensor]:
    """The linear-interpolation q-quantile of each row's valid values ([..., 1], float64) and
    whether the row has any (rows without one get 0)."""
    n = valid.sum(dim=-1, keepdim=True)
    xs, _ = torch.sort(torch.where(valid, x.to(_F), torch.full_like(x, math.inf, dtype=_F)), dim=-1)
    pos = q * (n - 1).clamp(min=0).to(_F)
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
    a, b = xs.gather(-1, lo), xs.gather(-1, hi)
    out = a + (b - a) * (pos - lo.to(_F))
    has = n > 0
    return torch.where(has, out, torch.zeros_like(out)), has


def prefix_thresholds(D: Tensor, scan: Tensor, *, delta: float, w_min: float, delta_b: float,
                      horizon: str | int, calibrate: bool, calibrate_quantile: float,
                      calibrate_max_mult: float) -> tuple[Tensor, Tensor, Tensor]:
    """(Z, c, δ_b per token), float64, [..., S]: the weighted divergences, the effective thresholds
    c_t and each token's response budget rate. `scan` marks the tokens that count (bool)."""
    t, length = positions(scan)
    if horizon == "response":
        T = length
    elif isinstance(horizon, int) and not isinstance(horizon, bool) and horizon >= 1:
        T = horizon
    else:
        raise ValueError(f"cppo horizon={horizon!r}: 'response' (each response's own length) or a "
                         "positive integer (a fixed length, e.g. the maximum response length)")
    w = torch.where(scan, position_weights(t, T, w_min), torch.zeros((), dtype=_F, device=D.device))
    D = torch.where(scan, D.detach().to(_F), torch.zeros((), dtype=_F, device=D.device))
    Z = w * D
    rate = torch.full_like(length, delta_b, dtype=_F)
    if calibrate:
        p, has = row_quantile(D, scan, calibrate_quantile)
        rate = torch.where(has, p.clamp(min=delta_b, max=calibrate_max_mult * delta_b), rate)
    # Exclusive prefix sums S_{t−1}, W_{t−1}: shift the inclusive ones by one position.
    S_prev = torch.nn.functional.pad(torch.cumsum(Z, dim=-1), (1, -1))
    W_prev = torch.nn.functional.pad(torch.cumsum(w, dim=-1), (1, -1))
    budget = torch.where(W_prev > 0, rate * W_prev, torch.zeros_like(W_prev))  # δ_b = ∞ at t = 1: 0, not NaN
    c = torch.clamp(delta + budget - S_prev, max=delta)
    return Z, c, rate.expand_as(Z)


@register("policy_loss", "cppo")
def cppo_loss(
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, *,
    divergence: Tensor | None = None, divergence_type: str = "binary_tv",
    delta: float | None = None, truncation: float = math.inf,
    w_min: float = 0.8, delta_b: float = 0.02, horizon: str | int = "response",
    calibrate: bool = True, calibrate_quantile: float = 0.9, calibrate_max_mult: float = 2.0,
    scan_mask: Tensor | None = None,
    old_logp: Tensor | None = None, anchor: str = "rollout", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CPPO (module docstring; ALGORITHMS.md §12). Loss and gradient of a kept token are DPPO's,
    −A·min(ρ, C)·∇log π; a masked token's are exactly 0 (it stays in the normaliser).

    `horizon`: "response" (each response's own length) or an int (a fixed length; the trainer
    passes the recipe's maximum response length unless loss_kwargs sets it). `calibrate`: δ_b per
    response from the `calibrate_quantile` of its divergences, clamped to [δ_b, calibrate_max_mult·δ_b].
    `scan_mask`: the tokens the prefix sums and the quantile run over, when they are more than
    `response_mask` (the trainer's diagnostics of a subset of a response's tokens); default the
    valid tokens. δ defaults as DPPO's: 0.15 for TV, 0.05 for KL.

    Metrics beside DPPO's: `cppo_threshold` (c_t), `cppo_delta_b` (the response's δ_b),
    `cppo_token_masked` (masked with Z_t > δ: the position-weighted token test alone masks it),
    `cppo_budget_masked` (masked only because the prefix budget lowered c_t below Z_t ≤ δ),
    `cppo_tightened` (c_t < δ) and `cppo_negative` (c_t < 0).
    """
    if not 0.0 < w_min <= 1.0:
        raise ValueError(f"cppo w_min={w_min} must lie in (0, 1]")
    if not delta_b >= 0:
        raise ValueError(f"cppo delta_b={delta_b} must be >= 0 (math.inf: no prefix budget)")
    if calibrate and not (0.0 <= calibrate_quantile <= 1.0 and calibrate_max_mult >= 1.0):
        raise ValueError(f"cppo calibrate_quantile={calibrate_quantile} must lie in [0, 1] and "
                         f"calibrate_max_mult={calibrate_max_mult} be >= 1")
    if logp.dim() < 1:
        raise ValueError("cppo needs log-probs with a positions dimension (the last)")
    valid, logp, rollout_logp, advantages, old_logp = _prepare(
        logp, rollout_logp, advantages, old_logp, response_mask)
    scan = valid if scan_mask is None else (_valid(scan_mask, logp) | valid)
    anchor_logp = select_anchor(rollout_logp, old_logp, anchor)
    divergence, d = divergence_and_delta(divergence, divergence_type, anchor_logp, logp, delta)
    Z, c, rate = prefix_thresholds(divergence, scan, delta=d, w_min=w_min, delta_b=delta_b, horizon=horizon,
                                   calibrate=calibrate, calibrate_quantile=calibrate_quantile,
                                   calibrate_max_mult=calibrate_max_mult)

    lr = log_ratio(logp, anchor_logp)
    rd = torch.exp(lr).detach()
    away = (advantages.to(_F) * torch.expm1(lr.detach().to(_F))) > 0  # A·(ρ − 1) > 0: a move away from μ
    masked = away & (Z > c)
    loss, weight, clipped = masked_truncated_loss(masked, rd, advantages, logp, truncation)
    D = torch.where(valid, divergence.detach(), torch.zeros((), dtype=divergence.dtype, device=divergence.device))
    return _finish(loss, valid, ratio=rd, weight=weight, masked=masked, clipped=clipped, divergence=D,
                   cppo_threshold=c.to(rd.dtype), cppo_delta_b=rate.to(rd.dtype),
                   cppo_token_masked=masked & (Z > d), cppo_budget_masked=masked & (Z <= d),
                   cppo_tightened=c < d, cppo_negative=c < 0)
