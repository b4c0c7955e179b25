"""The thin adapter between the learner and the pure loss functions: masking, optional mismatch
correction, KL / entropy terms, aggregation with the global normaliser, diagnostics, and the only
collectives of this package (over an explicitly passed `dp_group`; None = single process).

Use per optimizer step (shapes [B, T] per micro-batch):

    N = global_normalizer([mb.response_mask for mb in my_micro_batches], agg_mode, dp_group=dp_group)
    for mb in my_micro_batches:
        loss, stats = compute_policy_loss("dppo", logp=..., rollout_logp=..., advantages=...,
                                          response_mask=..., normalizer=N, agg_mode=agg_mode)
        loss.backward()                      # or hand `loss` to Megatron's schedule
        all_stats = stats if first else all_stats.merge(stats)
    metrics = reduce_diagnostics(all_stats, dp_group=dp_group)

Each micro-batch's `loss` is its share of the step loss: summing over micro-batches and DP ranks
gives exactly the full-batch loss, so summed gradients do not depend on the layout. If the
gradient reduction *averages* over DP ranks (Megatron DDP's default) or the schedule divides by the
number of micro-batches, multiply the loss by those factors to undo it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Iterable

import torch
import torch.distributed as dist

from . import diagnostics
from .aggregation import aggregate, local_count
from .kl import entropy_bonus
from .registry import get

Tensor = torch.Tensor


_COMMON_METRICS = ("ratio", "weight", "masked", "clipped", "divergence")


def global_normalizer(response_masks: Tensor | Iterable[Tensor], agg_mode: str, *,
                      dp_group: Any = None) -> Tensor:
    """The step's normaliser for `agg_mode` (valid tokens or non-empty sequences), counted over
    this process's micro-batches and summed over `dp_group` (int64 scalar on the masks' device)."""
    masks = [response_masks] if isinstance(response_masks, Tensor) else list(response_masks)
    # On the masks' device: with NCCL the all-reduce takes device tensors only.
    count = sum((local_count(m, agg_mode) for m in masks[1:]), local_count(masks[0], agg_mode))
    if dp_group is not None:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=dp_group)
    return count


@functools.lru_cache(maxsize=None)
def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _zero_invalid(x: Tensor | None, valid: Tensor) -> Tensor | None:
    # Padding may hold garbage (−inf log-probs): replace it so no NaN reaches the loss or gradient.
    if x is None:
        return None
    return torch.where(valid, x, 0.0)


def compute_policy_loss(
    loss_name: str, *,
    logp: Tensor, rollout_logp: Tensor, advantages: Tensor, response_mask: Tensor,
    normalizer, agg_mode: str = "token-mean", max_response_length: int | None = None,
    loss_kwargs: dict | None = None,
    old_logp: Tensor | None = None, divergence: Tensor | None = None, entropy: Tensor | None = None,
    ref_logp: Tensor | None = None, kl_estimator: str = "k3", kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    correction: str | None = None, correction_kwargs: dict | None = None,
) -> tuple[Tensor, diagnostics.DiagnosticStats]:
    """One micro-batch's loss (scalar) and its diagnostics.

    per-token loss = correction_weight · policy_loss + kl_coef · KL(π‖π_ref) − entropy_coef · H,
    aggregated with `agg_mode` over the global `normalizer` (from `global_normalizer`).
    `divergence` is given to the policy loss when it takes one (DPPO) and always to diagnostics.
    `correction` ("tis" / "icepop") needs `old_logp`; `kl_coef` > 0 needs `ref_logp`;
    `entropy_coef` ≠ 0 needs `entropy` (with grad).
    """
    valid = response_mask.bool()
    logp = _zero_invalid(logp, valid)
    rollout_logp = _zero_invalid(rollout_logp.detach(), valid)
    advantages = _zero_invalid(advantages.detach(), valid)
    old_logp = _zero_invalid(None if old_logp is None else old_logp.detach(), valid)
    # A loss that scans whole responses (CPPO) may see more tokens than it trains on (`scan_mask`).
    scan = valid if (loss_kwargs or {}).get("scan_mask") is None else loss_kwargs["scan_mask"].bool() | valid
    divergence = _zero_invalid(None if divergence is None else divergence.detach(), scan)
    entropy = _zero_invalid(entropy, valid)
    ref_logp = _zero_invalid(None if ref_logp is None else ref_logp.detach(), valid)

    loss_fn = get("policy_loss", loss_name)
    kwargs = dict(loss_kwargs or {})
    if old_logp is not None:
        kwargs.setdefault("old_logp", old_logp)
    if divergence is not None and _accepts(loss_fn, "divergence"):
        kwargs.setdefault("divergence", divergence)
    if max_response_length is not None and _accepts(loss_fn, "horizon"):
        kwargs.setdefault("horizon", int(max_response_length))  # CPPO: the recipe's, not a padded width
    pg, metrics = loss_fn(logp, rollout_logp, advantages, response_mask=valid, **kwargs)

    extra: dict[str, Tensor] = {}
    if correction is not None:
        if old_logp is None:
            raise ValueError(f"correction {correction!r} needs old_logp (recomputed π_old log-probs)")
        weight, cmetrics = get("correction", correction)(
            old_logp, rollout_logp, response_mask=valid, **(correction_kwargs or {}))
        pg = pg * weight.to(pg.dtype)
        extra = {"correction_masked": cmetrics["masked"], "correction_clipped": cmetrics["clipped"]}

    def agg(x: Tensor) -> Tensor:
        return aggregate(x, valid, agg_mode, normalizer=normalizer, max_response_length=max_response_length)

    pg_loss = agg(pg)
    total = pg_loss
    totals = {"loss/pg": pg_loss.detach()}
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (reference-model log-probs)")
        kl_loss = agg(get("kl", kl_estimator)(logp, ref_logp))
        total = total + kl_coef * kl_loss
        totals["loss/kl"] = kl_loss.detach()
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy")
        total = total + agg(entropy_bonus(entropy, entropy_coef))
    if entropy is not None:
        totals["loss/entropy"] = agg(entropy).detach()
    totals["loss/total"] = total.detach()

    # A loss's own per-token statistics (DRPO's w, CPPO's thresholds), reported per split.
    own = {k: v for k, v in metrics.items() if k not in _COMMON_METRICS}
    stats = diagnostics.collect(
        response_mask=valid, advantages=advantages, rollout_logp=rollout_logp, logp=logp,
        masked=metrics["masked"], clipped=metrics["clipped"], ratio=metrics["ratio"],
        divergence=metrics.get("divergence", divergence), entropy=entropy, old_logp=old_logp,
        extra_indicators=extra, totals=totals,
        split_indicators={k: v for k, v in own.items() if v.dtype == torch.bool} or None,
        split_values={k: v for k, v in own.items() if v.dtype != torch.bool} or None,
    )
    return total, stats


def reduce_diagnostics(stats: diagnostics.DiagnosticStats, *, dp_group: Any = None) -> dict[str, float]:
    """Sum the additive statistics and max the maxima over `dp_group`, then finalize. Every rank
    must call this with the same keys (same loss, same optional inputs)."""
    if dp_group is not None:
        sums, maxes = stats.sums.clone(), stats.maxes.clone()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=dp_group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=dp_group)
        stats = diagnostics.DiagnosticStats(stats.sum_keys, sums, stats.max_keys, maxes, stats.ratios)
    return stats.finalize()
