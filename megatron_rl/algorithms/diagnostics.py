"""Per-token trust-region diagnostics: which tokens did the trust region stop?

The DPPO paper's central observation is that ratio clipping stops the wrong tokens: rare tokens
whose probability rises (large r, tiny probability mass moved) and not dominant tokens that lose
mass (r near 1, large mass moved). These statistics make that visible every step, for every loss:

- `masked_frac[/split]`: fraction of valid tokens whose gradient the trust region stopped;
  `clipped_frac[/split]`: fraction whose weight was capped but gradient kept (see policy_losses).
  Splits: by advantage sign (`adv_pos`, `adv_neg`), by rollout probability μ(a_t) bucket
  (`mu_lt_0.1`, `mu_0.1_0.9`, `mu_gt_0.9`; μ < 0.1, 0.1 ≤ μ ≤ 0.9, μ > 0.9) and by both
  (`adv_pos/mu_lt_0.1`, ...). Each fraction is over the tokens *of that split*; `token_frac/<split>`
  says what share of all tokens the split holds. An empty split reports 0.
- `divergence/mean`, `divergence/max` (when divergence values are given), `ratio/min|p05|p50|p95|max`,
  `entropy/mean` (entropy passed in), `abs_logp_diff/mean` = mean |log π − log μ| (the
  training/rollout mismatch users watch), `abs_old_logp_diff/mean` = mean |log π_old − log μ|
  when π_old is recomputed, `tokens` = number of valid tokens.

Everything but the quantiles is additive: `collect` returns sums, counts and maxima
(`DiagnosticStats`), which `merge` combines across micro-batches and `adapter.reduce_diagnostics`
all-reduces across data-parallel ranks before `finalize` divides. Quantiles are computed from the
ratios this process saw (all its micro-batches; not gathered across DP ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor

MU_BUCKETS = ("mu_lt_0.1", "mu_0.1_0.9", "mu_gt_0.9")
ADV_SPLITS = ("adv_pos", "adv_neg")
SPLITS = ("all",) + ADV_SPLITS + MU_BUCKETS + tuple(f"{a}/{m}" for a in ADV_SPLITS for m in MU_BUCKETS)
INDICATORS = ("masked", "clipped")
QUANTILES = {"p05": 0.05, "p50": 0.5, "p95": 0.95}
_F = torch.float64


def _scalar(x) -> Tensor:
    return torch.as_tensor(x, dtype=_F).detach().reshape(())


@dataclass
class DiagnosticStats:
    """Additive sums/counts, maxima and the local ratios of one or more micro-batches."""

    sums: dict[str, Tensor] = field(default_factory=dict)
    maxes: dict[str, Tensor] = field(default_factory=dict)
    ratios: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=_F))

    def merge(self, other: "DiagnosticStats") -> "DiagnosticStats":
        if set(self.sums) != set(other.sums) or set(self.maxes) != set(other.maxes):
            raise ValueError("cannot merge diagnostics with different keys "
                             f"({sorted(set(self.sums) ^ set(other.sums))})")
        return DiagnosticStats(
            sums={k: self.sums[k] + other.sums[k] for k in self.sums},
            maxes={k: torch.maximum(self.maxes[k], other.maxes[k]) for k in self.maxes},
            ratios=torch.cat([self.ratios, other.ratios]),
        )

    def finalize(self) -> dict[str, Tensor]:
        s, m = self.sums, self.maxes
        out: dict[str, Tensor] = {"tokens": s["count/all"]}
        total = s["count/all"].clamp_min(1)
        for split in SPLITS:
            count = s[f"count/{split}"]
            suffix = "" if split == "all" else f"/{split}"
            for ind in INDICATORS:
                out[f"{ind}_frac{suffix}"] = s[f"{ind}/{split}"] / count.clamp_min(1)
            if split != "all":
                out[f"token_frac/{split}"] = count / total
        for key in sorted(k for k in s if k.startswith("extra/") and k.endswith("/sum")):
            name = key[len("extra/"):-len("/sum")]
            out[f"{name}_frac"] = s[key] / total
        if s["divergence/count"] > 0:
            out["divergence/mean"] = s["divergence/sum"] / s["divergence/count"]
            out["divergence/max"] = m["divergence/max"]
        if s["entropy/count"] > 0:
            out["entropy/mean"] = s["entropy/sum"] / s["entropy/count"]
        if s["abs_old_logp_diff/count"] > 0:
            out["abs_old_logp_diff/mean"] = s["abs_old_logp_diff/sum"] / s["abs_old_logp_diff/count"]
        out["abs_logp_diff/mean"] = s["abs_logp_diff/sum"] / total
        has = s["count/all"] > 0
        zero = _scalar(0.0)
        out["ratio/max"] = torch.where(has, m["ratio/max"], zero)
        out["ratio/min"] = torch.where(has, -m["ratio/neg_min"], zero)
        for name, q in QUANTILES.items():
            out[f"ratio/{name}"] = quantile(self.ratios, q)
        for key in sorted(k for k in s if k.startswith("total/")):
            out[key[len("total/"):]] = s[key]
        return out


def quantile(x: Tensor, q: float) -> Tensor:
    """Linear-interpolation quantile by sorting (torch.quantile caps its input at 2^24 elements);
    0 for an empty input."""
    x = x.reshape(-1).to(_F)
    n = x.numel()
    if n == 0:
        return _scalar(0.0)
    xs, _ = torch.sort(x)
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@torch.no_grad()
def collect(
    *, response_mask: Tensor, advantages: Tensor, rollout_logp: Tensor, logp: Tensor,
    masked: Tensor, clipped: Tensor, ratio: Tensor, divergence: Tensor | None = None,
    entropy: Tensor | None = None, old_logp: Tensor | None = None,
    extra_indicators: dict[str, Tensor] | None = None, totals: dict[str, Tensor] | None = None,
) -> DiagnosticStats:
    """Statistics of one micro-batch. All tensors have the token shape of `response_mask`.

    `extra_indicators` (bool per token) are counted over all valid tokens as `<name>_frac`;
    `totals` (already-normalised scalars, e.g. the aggregated loss terms) are summed as-is.
    """
    valid = response_mask.bool()
    A = advantages.detach()
    mu = torch.exp(rollout_logp.detach().to(_F))
    split_masks = {
        "all": valid,
        "adv_pos": valid & (A > 0),
        "adv_neg": valid & (A < 0),
        "mu_lt_0.1": valid & (mu < 0.1),
        "mu_0.1_0.9": valid & (mu >= 0.1) & (mu <= 0.9),
        "mu_gt_0.9": valid & (mu > 0.9),
    }
    for a in ADV_SPLITS:
        for b in MU_BUCKETS:
            split_masks[f"{a}/{b}"] = split_masks[a] & split_masks[b]
    indicators = {"masked": masked.bool(), "clipped": clipped.bool()}

    sums: dict[str, Tensor] = {}
    for split, sm in split_masks.items():
        sums[f"count/{split}"] = _scalar(sm.sum())
        for ind, val in indicators.items():
            sums[f"{ind}/{split}"] = _scalar((sm & val).sum())
    for name, val in (extra_indicators or {}).items():
        sums[f"extra/{name}/sum"] = _scalar((valid & val.bool()).sum())

    def masked_sum(x: Tensor) -> Tensor:
        x = x.detach().to(_F)
        return _scalar(torch.where(valid, x, torch.zeros_like(x)).sum())

    n_valid = sums["count/all"]
    zero = _scalar(0.0)
    sums["abs_logp_diff/sum"] = masked_sum((logp.detach().to(_F) - rollout_logp.detach().to(_F)).abs())
    sums["divergence/sum"] = masked_sum(divergence) if divergence is not None else zero
    sums["divergence/count"] = n_valid if divergence is not None else zero
    sums["entropy/sum"] = masked_sum(entropy) if entropy is not None else zero
    sums["entropy/count"] = n_valid if entropy is not None else zero
    if old_logp is not None:
        sums["abs_old_logp_diff/sum"] = masked_sum((old_logp.detach().to(_F) - rollout_logp.detach().to(_F)).abs())
        sums["abs_old_logp_diff/count"] = n_valid
    else:
        sums["abs_old_logp_diff/sum"] = zero
        sums["abs_old_logp_diff/count"] = zero
    for name, val in (totals or {}).items():
        sums[f"total/{name}"] = _scalar(val)

    r = ratio.detach().to(_F)[valid]
    neg_inf = _scalar(-torch.inf)
    maxes = {
        "ratio/max": r.max() if r.numel() else neg_inf,
        "ratio/neg_min": (-r).max() if r.numel() else neg_inf,
        "divergence/max": (divergence.detach().to(_F)[valid].max()
                           if divergence is not None and r.numel() else neg_inf),
    }
    return DiagnosticStats(sums=sums, maxes={k: _scalar(v) for k, v in maxes.items()}, ratios=r)
