"""Policy losses of the trust-region family — pure per-token tensor functions.

Notation (see ../shared/ALGORITHMS.md): π = training policy (`logp` = log π(a_t), with grad);
μ = rollout policy (`rollout_logp`, what the inference engine reported); π_old = the same weights
recomputed by the trainer (`old_logp`, optional); A = advantage (per token); sg = detach.
The *anchor* of every ratio and trust region is μ (`anchor="rollout"`, the default and the DPPO
paper's choice) or π_old (`anchor="old"`, the MiniRL-style ablation): r = π(a_t)/anchor(a_t).

Shapes: every tensor has the same shape, usually [B, T] (B sequences, T response positions);
`gspo` needs [B, T] because its ratio is a per-sequence mean. Optional `response_mask` (bool,
same shape) marks the valid tokens; invalid tokens get loss 0 and exactly zero gradient.

Every loss returns `(loss, metrics)`:
- `loss`: per-token loss (minimised; = −objective), same shape as `logp`. Aggregation over tokens
  is `aggregation.py`'s job.
- `metrics`: detached per-token tensors — `ratio` (r, or GSPO's sequence ratio), `weight` (the
  coefficient w of the gradient −A·w·∇log π; 0 where the gradient is stopped), `masked` (bool:
  the trust region stopped this token's gradient — PPO's clip fraction, DPPO's mask), `clipped`
  (bool: the weight was capped but the gradient kept — CISPO, DPPO truncation, ASPO's soft
  dual-clip), and `divergence` for DPPO. `diagnostics.py` turns them into logged fractions.

Loss values. A token whose gradient flows is written as −A · sg(w) · π/sg(π): its value is the
surrogate −A·w and its gradient −A·w·∇log π. ALGORITHMS.md writes DPPO/CISPO as −A·sg(w)·log π;
the gradient is identical, but that value depends on log π and is not comparable across losses,
so we report the surrogate instead. Tokens with a stopped gradient carry a constant value (PPO:
−A·clip(r); DPPO and ASPO: 0, the token is dropped).

The log-ratio is clamped to ±20 in value only (straight-through), so exp() stays finite for any
input while the gradient is always exactly the formula's.
"""

from __future__ import annotations

import functools
import math

import torch

from .divergence import binary_kl, binary_tv
from .registry import register

Tensor = torch.Tensor

LOG_RATIO_CLAMP = 20.0

# Default DPPO thresholds (ALGORITHMS.md §1): δ_TV = 0.15, δ_KL = 0.05.
DPPO_DIVERGENCES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl", "full_tv", "full_kl")
DEFAULT_DELTA_TV = 0.15
DEFAULT_DELTA_KL = 0.05


# ----------------------------------------------------------------------------- helpers

def _upcast(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _valid(response_mask: Tensor | None, like: Tensor) -> Tensor:
    if response_mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if response_mask.shape != like.shape:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}, "
                         f"log-probs have {tuple(like.shape)}")
    return response_mask.bool()


def _prepare(logp, rollout_logp, advantages, old_logp, response_mask):
    """Validity mask and inputs with invalid positions replaced by 0 (torch.where, so the gradient
    reaching an invalid log π is exactly 0 and −inf/NaN padding cannot turn into NaN gradients)."""
    valid = _valid(response_mask, logp)

    def clean(x):
        return None if x is None else torch.where(valid, _upcast(x), torch.zeros((), dtype=_upcast(x).dtype))

    return valid, clean(logp), clean(rollout_logp), clean(advantages), clean(old_logp)


def select_anchor(rollout_logp: Tensor, old_logp: Tensor | None, anchor: str) -> Tensor:
    """The anchor log-probs: μ for "rollout" (default), π_old for "old"."""
    if anchor == "rollout":
        return rollout_logp
    if anchor == "old":
        if old_logp is None:
            raise ValueError("anchor='old' needs old_logp (log-probs recomputed by the trainer)")
        return old_logp
    raise ValueError(f"unknown anchor {anchor!r}; valid anchors: 'rollout', 'old'")


def log_ratio(logp: Tensor, anchor_logp: Tensor) -> Tensor:
    """log(π/anchor) with grad through log π only; value clamped to ±20 (straight-through)."""
    raw = _upcast(logp) - _upcast(anchor_logp).detach()
    return raw + (raw.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) - raw.detach())


def unit(logp: Tensor) -> Tensor:
    """π/sg(π): value exactly 1, gradient ∇log π."""
    logp = _upcast(logp)
    return torch.exp(logp - logp.detach())


def _finish(loss: Tensor, valid: Tensor, **metrics: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Zero invalid tokens (torch.where: their gradient is exactly 0 even if inputs were inf)."""
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    out: dict[str, Tensor] = {}
    for key, value in metrics.items():
        value = value.detach()
        if value.dtype == torch.bool:
            out[key] = value & valid
        else:
            out[key] = torch.where(valid, value, torch.zeros_like(value))
    return loss, out


def divergence_and_delta(divergence: Tensor | None, divergence_type: str, anchor_logp: Tensor, logp: Tensor,
                         delta: float | None) -> tuple[Tensor, float]:
    """DPPO / CPPO: D (given, or the binary one from the sampled-token log-probs) and δ (given, or
    the default of D's kind: 0.15 for TV, 0.05 for KL)."""
    if divergence_type not in DPPO_DIVERGENCES:
        raise ValueError(f"unknown divergence_type {divergence_type!r}; valid: {', '.join(DPPO_DIVERGENCES)}")
    if divergence is None:
        if divergence_type == "binary_tv":
            divergence = binary_tv(anchor_logp, logp)
        elif divergence_type == "binary_kl":
            divergence = binary_kl(anchor_logp, logp)
        else:
            raise ValueError(f"divergence_type {divergence_type!r} needs the divergence values "
                             "(computed from the logits by megatron_rl.vocab_parallel)")
    default = DEFAULT_DELTA_TV if divergence_type.endswith("_tv") else DEFAULT_DELTA_KL
    return divergence, default if delta is None else delta


def masked_truncated_loss(masked: Tensor, ratio: Tensor, advantages: Tensor, logp: Tensor,
                          truncation: float) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, weight, clipped) of a divergence trust region: −M·A·sg(min(r, C))·π/sg(π), a masked
    token's loss and gradient exactly 0 (DPPO, CPPO)."""
    w = ratio.clamp(max=truncation) if math.isfinite(truncation) else ratio
    loss = torch.where(masked, torch.zeros_like(ratio), -advantages * w * unit(logp))
    weight = torch.where(masked, torch.zeros_like(w), w)
    return loss, weight, ~masked & (ratio > truncation)


def _clip_bounds(eps_low, eps_high) -> tuple:
    return 1.0 - eps_low, 1.0 + eps_high


# ----------------------------------------------------------------------------- losses

@register("policy_loss", "pg_is")
def pg_is_loss(
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, *,
    old_logp: Tensor | None = None, anchor: str = "rollout", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PG-IS: −A·r, no trust region (M = 1, C = ∞). Gradient −A·r·∇log π."""
    valid, logp, rollout_logp, advantages, old_logp = _prepare(
        logp, rollout_logp, advantages, old_logp, response_mask)
    r = torch.exp(log_ratio(logp, select_anchor(rollout_logp, old_logp, anchor)))
    loss = -advantages * r
    no = torch.zeros_like(valid)
    return _finish(loss, valid, ratio=r, weight=r, masked=no, clipped=no)


@register("policy_loss", "ppo")
def ppo_loss(
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, *,
    eps_low: float | Tensor = 0.2, eps_high: float | Tensor = 0.2, dual_clip: float | None = None,
    old_logp: Tensor | None = None, anchor: str = "rollout", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip: max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)); clip-higher = ε_high 0.28 (DAPO).

    Dual-clip (c = `dual_clip` > 1, None = off): for A < 0 additionally min(·, −A·c); where it binds
    the value is the constant −A·c and the gradient is zero. `eps_low`/`eps_high` may be per-token
    tensors. The clip binds (zero gradient) iff A>0 and r>1+ε_high, or A<0 and r<1−ε_low.
    """
    valid, logp, rollout_logp, advantages, old_logp = _prepare(
        logp, rollout_logp, advantages, old_logp, response_mask)
    r = torch.exp(log_ratio(logp, select_anchor(rollout_logp, old_logp, anchor)))
    rd = r.detach()
    lo, hi = _clip_bounds(eps_low, eps_high)
    pos, neg = advantages > 0, advantages < 0
    clip_binds = (pos & (rd > hi)) | (neg & (rd < lo))
    clipped_r = torch.minimum(torch.maximum(rd, torch.as_tensor(lo, dtype=rd.dtype)),
                              torch.as_tensor(hi, dtype=rd.dtype))
    loss = torch.where(clip_binds, -advantages * clipped_r, -advantages * r)
    masked = clip_binds
    if dual_clip is not None:
        if not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); use None to turn it off")
        # For A<0 the clipped loss is |A|·max(r, clip(r)); it exceeds |A|·c exactly when r > c.
        dual_binds = neg & (rd > dual_clip)
        loss = torch.where(dual_binds, -advantages * dual_clip, loss)
        masked = masked | dual_binds
    weight = torch.where(masked, torch.zeros_like(rd), rd)
    return _finish(loss, valid, ratio=rd, weight=weight, masked=masked,
                   clipped=torch.zeros_like(masked))


@register("policy_loss", "dppo")
def dppo_loss(
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, *,
    divergence: Tensor | None = None, divergence_type: str = "binary_tv",
    delta: float | None = None, delta_low: float | None = None, delta_high: float | None = None,
    truncation: float = math.inf,
    old_logp: Tensor | None = None, anchor: str = "rollout", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO: divergence trust region anchored on μ (DPPO paper, ALGORITHMS.md §1).

    Mask M_t = 0 iff (A>0 and π(a_t)>anchor(a_t) and D_t>δ_high) or (A<0 and π(a_t)<anchor(a_t)
    and D_t>δ_low); moves back toward the anchor are never masked. Loss −M·A·sg(min(r, C))·π/sg(π),
    so the gradient is −M·A·min(r, C)·∇log π (C = `truncation`: ∞ in the stability study, 5 in the
    scaling runs). D is `divergence` (values from `megatron_rl.vocab_parallel` for top-K / full);
    for binary_tv / binary_kl it is computed here from the sampled-token log-probs when omitted.
    δ defaults: 0.15 for TV, 0.05 for KL; `delta` sets both sides, `delta_low`/`delta_high` each.
    """
    valid, logp, rollout_logp, advantages, old_logp = _prepare(
        logp, rollout_logp, advantages, old_logp, response_mask)
    anchor_logp = select_anchor(rollout_logp, old_logp, anchor)
    divergence, base = divergence_and_delta(divergence, divergence_type, anchor_logp, logp, delta)
    d_low = base if delta_low is None else delta_low
    d_high = base if delta_high is None else delta_high

    lr = log_ratio(logp, anchor_logp)
    rd = torch.exp(lr).detach()
    D = torch.where(valid, divergence.detach(), torch.zeros((), dtype=divergence.dtype))
    up = lr.detach() > 0      # π(a_t) > anchor(a_t)
    down = lr.detach() < 0
    masked = ((advantages > 0) & up & (D > d_high)) | ((advantages < 0) & down & (D > d_low))
    loss, weight, clipped = masked_truncated_loss(masked, rd, advantages, logp, truncation)
    return _finish(loss, valid, ratio=rd, weight=weight, masked=masked, clipped=clipped, divergence=D)


DEFAULT_DELTA_DRPO = 12.5  # the DRPO paper's reported δ (ALGORITHMS.md §10; see the caveat there)


@register("policy_loss", "drpo")
def drpo_loss(
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, *,
    delta: float = DEFAULT_DELTA_DRPO,
    old_logp: Tensor | None = None, anchor: str = "rollout", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRPO (ALGORITHMS.md §10): DPPO's Binary-TV geometry with the hard mask replaced by a smooth,
    advantage-weighted quadratic penalty anchored on μ (or π_old with anchor="old"):

        J_t = r·A − (|A| / (2δ))·μ·(r − 1)²,   loss ℓ_t = −J_t,   r = π(a_t)/μ(a_t)

    (μ(r−1)² = (π−μ)²/μ: an advantage-weighted squared probability shift). No mask, no truncation.
    Gradient: ∇ℓ_t = −A·r·w·∇log π with w = 1 − sign(A)·(π − μ)/δ — 1 at μ, 0 exactly at DPPO's
    boundary |π − μ| = δ on the advantage's side, negative beyond it (a pull back toward μ), above 1
    when π has moved against the advantage. The loss is written in the quadratic form (its value is
    −J_t, its autograd gradient the formula's); the detached form −sg(A·r·w)·log π has the same
    gradient (a float64 test checks both).

    Metrics: `weight` = r·w (the coefficient of −A·∇log π), `drpo_w` = w, `reversed` = w < 0
    (the corrective regime); nothing is masked or clipped.
    """
    if not delta > 0:
        raise ValueError(f"drpo needs delta > 0 (got {delta}); the paper reports 12.5, DPPO's 0.15 is "
                         "the scale where the corrective regime is reached")
    valid, logp, rollout_logp, advantages, old_logp = _prepare(
        logp, rollout_logp, advantages, old_logp, response_mask)
    anchor_logp = select_anchor(rollout_logp, old_logp, anchor).detach()
    r = torch.exp(log_ratio(logp, anchor_logp))
    mu = torch.exp(anchor_logp)
    loss = -(advantages * r - advantages.abs() / (2.0 * delta) * mu * (r - 1.0) ** 2)
    rd = r.detach()
    w = 1.0 - torch.sign(advantages) * mu * (rd - 1.0) / delta  # μ(r−1) = π − μ
    no = torch.zeros_like(valid)
    return _finish(loss, valid, ratio=rd, weight=rd * w, masked=no, clipped=no,
                   drpo_w=w, reversed=w < 0)


@register("policy_loss", "aspo")
def aspo_loss(
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, *,
    eps_low: float | Tensor = 0.2, eps_high: float | Tensor = 0.2, dual_clip: float = 3.0,
    old_logp: Tensor | None = None, anchor: str = "rollout", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """ASPO: flipped IS weight for A>0 plus soft dual-clip on both signs (ALGORITHMS.md §2).

    - Hard mask (dropped, value 0): A>0 and r>1+ε_high, or A<0 and r<1−ε_low.
    - A>0: weight 1/r built as (r/sg(r))/sg(r): value 1/r, gradient (1/r)·∇log π. A differentiable
      1/r would have gradient −(1/r)·∇log π — the wrong sign.
    - A<0: weight r (ordinary IS).
    - Soft dual-clip: where the weight (1/r for A>0, r for A<0) exceeds c, the loss is −A·c·π/sg(π)
      (c constant; unlike PPO's dual-clip the gradient −A·c·∇log π is kept).
    `eps_low`/`eps_high` may be per-token tensors, e.g. from `aspo_entropy_eps`.
    """
    if not dual_clip > 1.0:
        raise ValueError(f"ASPO dual_clip must be > 1 (got {dual_clip})")
    valid, logp, rollout_logp, advantages, old_logp = _prepare(
        logp, rollout_logp, advantages, old_logp, response_mask)
    r = torch.exp(log_ratio(logp, select_anchor(rollout_logp, old_logp, anchor)))
    rd = r.detach()
    lo, hi = _clip_bounds(eps_low, eps_high)
    pos, neg = advantages > 0, advantages < 0
    hard = (pos & (rd > hi)) | (neg & (rd < lo))
    flipped = (r / rd) / rd
    is_weight = torch.where(pos, 1.0 / rd, rd)
    soft = (pos | neg) & ~hard & (is_weight > dual_clip)
    loss = torch.where(pos, -advantages * flipped, -advantages * r)
    loss = torch.where(soft, -advantages * dual_clip * unit(logp), loss)
    loss = torch.where(hard, torch.zeros_like(loss), loss)
    weight = torch.where(hard, torch.zeros_like(rd), torch.where(soft, torch.full_like(rd, dual_clip), is_weight))
    return _finish(loss, valid, ratio=rd, weight=weight, masked=hard, clipped=soft)


def aspo_entropy_eps(
    entropy: Tensor, response_mask: Tensor | None = None, *,
    eps_low_entropy: float = 0.2, eps_high_entropy: float = 0.4, top_frac: float = 0.2,
) -> Tensor:
    """ASPO's per-token ε: `eps_high_entropy` for the top-`top_frac` entropy tokens of each sequence
    (entropy strictly above the sequence's (1−top_frac)-quantile of valid tokens, linear
    interpolation), `eps_low_entropy` for the rest. entropy: [B, T]; returns [B, T]."""
    valid = _valid(response_mask, entropy)
    ent = torch.where(valid, _upcast(entropy.detach()), torch.full_like(_upcast(entropy), math.nan))
    thresh = torch.nanquantile(ent, 1.0 - top_frac, dim=-1, keepdim=True)
    high = valid & (ent > thresh)
    return torch.where(high, torch.full_like(ent, eps_high_entropy), torch.full_like(ent, eps_low_entropy))


# ATR-GRPO: KL3 bound w − 1 − log w ≤ δ  ⇔  l ≤ w ≤ u with l = −W₀(−e^{−(1+δ)}), u = −W₋₁(−e^{−(1+δ)}).

def lambert_w(z: float, branch: int = 0) -> float:
    """Real Lambert W (w·e^w = z) on branch 0 (w ≥ −1, z ≥ −1/e) or −1 (w ≤ −1, −1/e ≤ z < 0).

    scipy is not a dependency, so: an initial guess from the branch-point series
    w ≈ −1 ± p − p²/3 + 11p³/72, p = √(2(e·z + 1)) near z = −1/e, or from the asymptotic forms
    elsewhere, polished by Halley iterations in float64 (cubic convergence; 3–5 steps suffice).
    """
    if branch not in (0, -1):
        raise ValueError(f"branch must be 0 or -1 (got {branch})")
    branch_point = -math.exp(-1.0)
    if not z >= branch_point - 1e-15:
        raise ValueError(f"Lambert W is not real for z = {z} < -1/e")
    if branch == -1 and not z < 0:
        raise ValueError(f"branch -1 needs -1/e <= z < 0 (got {z})")
    p = math.sqrt(max(2.0 * (math.e * z + 1.0), 0.0))
    if p == 0.0:
        return -1.0
    if branch == 0:
        if z < -0.25:
            w = -1.0 + p - p * p / 3.0 + 11.0 / 72.0 * p ** 3
        elif z < 3.0:
            w = math.log1p(z)
        else:
            w = math.log(z) - math.log(math.log(z))
    else:
        if z < -0.25:
            w = -1.0 - p - p * p / 3.0 - 11.0 / 72.0 * p ** 3
        else:
            lz = math.log(-z)
            w = lz - math.log(-lz)
    for _ in range(50):
        ew = math.exp(w)
        f = w * ew - z
        wp1 = w + 1.0
        if f == 0.0 or wp1 == 0.0:
            break
        step = f / (ew * wp1 - (w + 2.0) * f / (2.0 * wp1))
        w -= step
        if abs(step) <= 4e-16 * (1.0 + abs(w)):
            break
    return w


@functools.lru_cache(maxsize=None)
def atr_bounds(delta: float) -> tuple[float, float]:
    """(l, u) with k3(l) = k3(u) = δ, k3(w) = w − 1 − log w; l < 1 < u, u − 1 > 1 − l.

    δ = 0.0231 → (0.800, 1.231); δ = 0.01 → (0.865, 1.148). Cached: computed once per δ.
    """
    if not delta > 0:
        raise ValueError(f"ATR delta must be > 0 (got {delta})")
    z = -math.exp(-(1.0 + delta))
    return -lambert_w(z, 0), -lambert_w(z, -1)


@register("policy_loss", "atr")
def atr_loss(
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, *,
    delta: float = 0.0231, dual_clip: float | None = None,
    old_logp: Tensor | None = None, anchor: str = "rollout", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """ATR-GRPO: PPO clip with the asymmetric range [l, u] = `atr_bounds(delta)` from the KL3 bound.

    The default δ = 0.0231 gives l = 0.800 (the usual ε_low = 0.2) and u = 1.231.
    """
    l, u = atr_bounds(float(delta))
    return ppo_loss(logp, rollout_logp, advantages, eps_low=1.0 - l, eps_high=u - 1.0,
                    dual_clip=dual_clip, old_logp=old_logp, anchor=anchor, response_mask=response_mask)


@register("policy_loss", "cispo")
def cispo_loss(
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, *,
    eps_low: float | None = None, eps_high: float | None = 0.2,
    old_logp: Tensor | None = None, anchor: str = "rollout", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: −sg(clip(r, 1−ε_low, 1+ε_high))·A·π/sg(π) — the weight is clipped, every token keeps
    its gradient. `None` turns a side off (default: lower side off, ε_high = 0.2). With only an
    upper cap C = 1+ε_high this is PG-TIS."""
    valid, logp, rollout_logp, advantages, old_logp = _prepare(
        logp, rollout_logp, advantages, old_logp, response_mask)
    rd = torch.exp(log_ratio(logp, select_anchor(rollout_logp, old_logp, anchor))).detach()
    w = rd
    if eps_low is not None:
        w = w.clamp(min=1.0 - eps_low)
    if eps_high is not None:
        w = w.clamp(max=1.0 + eps_high)
    loss = -advantages * w * unit(logp)
    return _finish(loss, valid, ratio=rd, weight=w, masked=torch.zeros_like(valid), clipped=w != rd)


@register("policy_loss", "gspo")
def gspo_loss(
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, *,
    eps_low: float = 3e-4, eps_high: float = 4e-4,
    old_logp: Tensor | None = None, anchor: str = "rollout", response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (token form): s_i = exp(mean over the valid tokens of sequence i of log r_t);
    s_{i,t} = sg(s_i)·π/sg(π); loss max(−A·s_{i,t}, −A·clip(s_{i,t}, 1−ε_low, 1+ε_high)).

    Needs [B, T] inputs (the mean runs over the last dim, using `response_mask` per sequence).
    Use it with seq-mean-token-mean aggregation: then the gradient is GSPO's sequence-level one.
    """
    if logp.dim() != 2:
        raise ValueError(f"gspo needs [B, T] log-probs (got shape {tuple(logp.shape)})")
    valid, logp, rollout_logp, advantages, old_logp = _prepare(
        logp, rollout_logp, advantages, old_logp, response_mask)
    anchor_logp = select_anchor(rollout_logp, old_logp, anchor)
    lr = (_upcast(logp) - _upcast(anchor_logp)).detach()
    lr = torch.where(valid, lr, torch.zeros_like(lr))
    n = valid.sum(dim=-1, keepdim=True).clamp_min(1)
    seq_lr = (lr.sum(dim=-1, keepdim=True) / n).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = torch.exp(seq_lr).expand_as(lr)
    s_tok = s * unit(logp)
    lo, hi = _clip_bounds(eps_low, eps_high)
    pos, neg = advantages > 0, advantages < 0
    clip_binds = (pos & (s > hi)) | (neg & (s < lo))
    loss = torch.where(clip_binds, -advantages * s.clamp(lo, hi), -advantages * s_tok)
    weight = torch.where(clip_binds, torch.zeros_like(s), s)
    return _finish(loss, valid, ratio=s, weight=weight, masked=clip_binds,
                   clipped=torch.zeros_like(clip_binds))
