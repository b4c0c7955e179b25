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
    """Additive sums/counts, maxima and the local ratios of one or more micro-batches.

    The sums and maxima are float64 vectors named by `sum_keys` / `max_keys`, so merging micro-
    batches and reducing over data-parallel ranks are one tensor op each, whatever the number of
    statistics (they are collected on every micro-batch of every step).
    """

    sum_keys: tuple[str, ...]
    sums: Tensor
    max_keys: tuple[str, ...]
    maxes: Tensor
    ratios: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=_F))

    def merge(self, other: "DiagnosticStats") -> "DiagnosticStats":
        if self.sum_keys != other.sum_keys or self.max_keys != other.max_keys:
            raise ValueError("cannot merge diagnostics with different keys "
                             f"({sorted(set(self.sum_keys) ^ set(other.sum_keys))})")
        return DiagnosticStats(self.sum_keys, self.sums + other.sums, self.max_keys,
                               torch.maximum(self.maxes, other.maxes),
                               torch.cat([self.ratios, other.ratios]))

    def finalize(self) -> dict[str, float]:
        s = dict(zip(self.sum_keys, self.sums.tolist()))
        m = dict(zip(self.max_keys, self.maxes.tolist()))
        out: dict[str, float] = {"tokens": s["count/all"]}
        total = max(s["count/all"], 1.0)
        split_kinds = [k[:-len("/all")] for k in s if k.startswith(("ind:", "val:")) and k.endswith("/all")]
        for split in SPLITS:
            count = s[f"count/{split}"]
            suffix = "" if split == "all" else f"/{split}"
            for ind in INDICATORS:
                out[f"{ind}_frac{suffix}"] = s[f"{ind}/{split}"] / max(count, 1.0)
            for kind in split_kinds:  # a loss's own per-split indicators and values (DRPO's w)
                name = kind[4:]
                key = f"{name}_frac{suffix}" if kind.startswith("ind:") else f"{name}/mean{suffix}"
                out[key] = s[f"{kind}/{split}"] / max(count, 1.0)
            if split != "all":
                out[f"token_frac/{split}"] = count / total
        for key in sorted(k for k in s if k.startswith("extra/") and k.endswith("/sum")):
            out[f"{key[len('extra/'):-len('/sum')]}_frac"] = s[key] / total
        for name in ("divergence", "entropy", "abs_old_logp_diff"):
            if s.get(f"{name}/count", 0) > 0:
                out[f"{name}/mean"] = s[f"{name}/sum"] / s[f"{name}/count"]
        if "divergence/mean" in out:
            out["divergence/max"] = m["divergence/max"]
        out["abs_logp_diff/mean"] = s["abs_logp_diff/sum"] / total
        has = s["count/all"] > 0
        out["ratio/max"] = m["ratio/max"] if has else 0.0
        out["ratio/min"] = -m["ratio/neg_min"] if has else 0.0
        for name, q in QUANTILES.items():
            out[f"ratio/{name}"] = float(quantile(self.ratios, q))
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


# Each split is (advantage selector, μ selector); selector 0 = everything. Order = SPLITS.
_SPLIT_GRID = [(0, 0), (1, 0), (2, 0), (0, 1), (0, 2), (0, 3)] + [(a, b) for a in (1, 2) for b in (1, 2, 3)]
_COUNT_KEYS = tuple(f"{kind}/{split}" for split in SPLITS for kind in ("count",) + INDICATORS)


@torch.no_grad()
def collect(
    *, response_mask: Tensor, advantages: Tensor, rollout_logp: Tensor, logp: Tensor,
    masked: Tensor, clipped: Tensor, ratio: Tensor, divergence: Tensor | None = None,
    entropy: Tensor | None = None, old_logp: Tensor | None = None,
    extra_indicators: dict[str, Tensor] | None = None, totals: dict[str, Tensor] | None = None,
    split_indicators: dict[str, Tensor] | None = None, split_values: dict[str, Tensor] | None = None,
) -> DiagnosticStats:
    """Statistics of one micro-batch. All tensors have the token shape of `response_mask`.

    `split_indicators` (bool per token) and `split_values` (float per token) are a loss's own
    statistics, reported per split like the masked fraction: `<name>_frac[/split]` and
    `<name>/mean[/split]` (DRPO's `reversed` = w < 0 and its weight `drpo_w`).
    `extra_indicators` (bool per token) are counted over all valid tokens as `<name>_frac`;
    `totals` (already-normalised scalars, e.g. the aggregated loss terms) are summed as-is.
    A handful of batched ops whatever the number of splits: this runs on every micro-batch.
    """
    valid = response_mask.reshape(-1).bool()
    A = advantages.detach().reshape(-1)
    mu = torch.exp(rollout_logp.detach().reshape(-1).to(_F))
    everything = torch.ones_like(valid)
    adv_sel = torch.stack([everything, A > 0, A < 0])
    mu_sel = torch.stack([everything, mu < 0.1, (mu >= 0.1) & (mu <= 0.9), mu > 0.9])
    a_idx, m_idx = zip(*_SPLIT_GRID)
    splits = (adv_sel[list(a_idx)] & mu_sel[list(m_idx)] & valid).to(_F)        # [n_splits, N]
    own = {f"ind:{k}": v.reshape(-1).bool() for k, v in (split_indicators or {}).items()}
    own |= {f"val:{k}": v.detach().reshape(-1).to(_F) for k, v in (split_values or {}).items()}
    rows = [everything, masked.reshape(-1).bool(), clipped.reshape(-1).bool()] + list(own.values())
    indicators = torch.stack([torch.where(valid, r.to(_F), 0.0) for r in rows])
    counts = splits @ indicators.T                        # [n_splits, 3 + own], exact for the counts
    extra = extra_indicators or {}
    if extra:
        ind = torch.stack([v.reshape(-1).bool() for v in extra.values()]) & valid
        counts = torch.cat([counts.reshape(-1), ind.sum(-1).to(_F)])

    # Masked sums of per-token values; the count of each is the number of valid tokens.
    values = {"abs_logp_diff": (logp.detach().to(_F) - rollout_logp.detach().to(_F)).abs()}
    if divergence is not None:
        values["divergence"] = divergence.detach().to(_F)
    if entropy is not None:
        values["entropy"] = entropy.detach().to(_F)
    if old_logp is not None:
        values["abs_old_logp_diff"] = (old_logp.detach().to(_F) - rollout_logp.detach().to(_F)).abs()
    value_sums = torch.where(valid, torch.stack([v.reshape(-1) for v in values.values()]), 0.0).sum(-1)
    n_valid = counts.reshape(-1)[:1].expand(len(values) - 1)  # count/all, for all but abs_logp_diff
    tot = torch.stack([_scalar(v) for v in totals.values()]) if totals else counts.new_zeros(0)

    count_keys = _COUNT_KEYS if not own else tuple(
        f"{kind}/{split}" for split in SPLITS for kind in ("count",) + INDICATORS + tuple(own))
    sum_keys = (count_keys + tuple(f"extra/{k}/sum" for k in extra)
                + tuple(f"{k}/sum" for k in values)
                + tuple(f"{k}/count" for k in values if k != "abs_logp_diff")
                + tuple(f"total/{k}" for k in (totals or {})))
    sums = torch.cat([counts.reshape(-1), value_sums, n_valid, tot])

    ratio = ratio.detach().reshape(-1).to(_F)
    max_rows = [ratio, -ratio] + ([values["divergence"].reshape(-1)] if divergence is not None else [])
    max_rows = torch.where(valid, torch.stack(max_rows), -torch.inf)
    maxes = max_rows.amax(-1) if max_rows.shape[1] else max_rows.new_full((len(max_rows),), -torch.inf)
    max_keys = ("ratio/max", "ratio/neg_min") + (("divergence/max",) if divergence is not None else ())
    return DiagnosticStats(sum_keys, sums, max_keys, maxes, ratios=ratio[valid])
