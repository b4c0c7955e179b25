"""Advantage estimators (ALGORITHMS.md §5) — pure functions over the whole global batch.

Shapes: B = sequences in the batch, T = response positions. Every estimator has the signature

    fn(token_rewards_BT, response_mask_BT, *, group_ids_B=None, values_BT=None, **hparams)
        -> (advantages_BT, returns_BT)

`token_rewards_BT` holds per-token rewards (an outcome reward sits on the last response token,
optionally with a per-token KL penalty elsewhere); outcome estimators use R_i = Σ_t r_{i,t} over
valid tokens and broadcast their advantage over the valid tokens of sequence i. `group_ids_B`
(integers, any labels) says which prompt each sample answers. Invalid tokens get 0.
For outcome estimators `returns` = advantages (there is no critic to train).

- grpo: (R_i − mean_g)/(std_g + 1e-6) (std unbiased); `norm_by_std=False` gives R_i − mean_g.
- dr_grpo: R_i − mean_g (the DPPO paper's choice).
- rloo: R_i − mean_{j≠i} R_j = n/(n−1)·(R_i − mean_g).
- reinforce_pp: discounted return G_t = r_t + γ G_{t+1}, whitened over the valid tokens of the batch.
- reinforce_pp_baseline: R_i − mean_g broadcast to tokens, whitened over the batch's valid tokens.
- gae: δ_t = r_t + γV_{t+1} − V_t, A_t = δ_t + γλA_{t+1} (reverse scan), returns = A + V, then A
  whitened. Invalid positions inside a response (multi-turn holes) are skipped by the scan.
A singleton group has no baseline: its group-relative advantage is 0.
`whiten=True` on the group estimators additionally whitens over the batch's valid tokens.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .registry import register

Tensor = torch.Tensor

GRPO_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


_SPREAD: contextvars.ContextVar = contextvars.ContextVar("advantages_spread", default=None)


@contextlib.contextmanager
def spread_over(group, device):
    """Inside the block, the batch handed to an estimator is this rank's part of a batch spread
    over the data-parallel `group` (a group may span ranks): group statistics and batch whitening
    use the whole batch (a few per-sequence numbers are all-gathered, token sums all-reduced), so
    the advantages equal those of the whole batch on one process."""
    token = _SPREAD.set((group, device))
    try:
        yield
    finally:
        _SPREAD.reset(token)


def _sum(x: Tensor) -> Tensor:
    spread = _SPREAD.get()
    if spread is None:
        return x
    from megatron_rl.distributed.collectives import all_reduce_sum

    return all_reduce_sum(x, *spread)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    mask = mask.bool()
    sums = _sum(torch.stack([torch.where(mask, x, torch.zeros_like(x)).sum(), mask.sum().to(x.dtype)]))
    return sums[0] / sums[1].clamp_min(1)


def whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = WHITEN_EPS) -> Tensor:
    """(x − mean)/sqrt(var + eps) over valid tokens (unbiased variance); invalid tokens → 0.
    `shift_mean=False` keeps the mean (only rescales)."""
    mask = mask.bool()
    n = _sum(mask.sum())
    mean = masked_mean(x, mask)
    centred = torch.where(mask, x - mean, torch.zeros_like(x))
    var = _sum(centred.square().sum()) / (n - 1).clamp_min(1)
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + torch.where(mask, mean, torch.zeros_like(mean))
    return torch.where(mask, out, torch.zeros_like(out))


_whiten = whiten  # the estimators' `whiten: bool` option shadows the name inside them


def outcome_rewards(token_rewards_BT: Tensor, response_mask_BT: Tensor) -> Tensor:
    """R_i = Σ_t r_{i,t} over valid tokens."""
    mask = response_mask_BT.bool()
    return torch.where(mask, token_rewards_BT, torch.zeros_like(token_rewards_BT)).sum(dim=-1)


def group_stats(values_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, unbiased group std, group size), each [B]. std is 0 for singletons."""
    if group_ids_B.shape != values_B.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids_B.shape)}, rewards {tuple(values_B.shape)}")
    spread = _SPREAD.get()
    if spread is not None:
        # Groups may be split across ranks: the statistics of all sequences, read at ours.
        from megatron_rl.distributed.collectives import all_gather_varlen

        import torch.distributed as dist

        vals = all_gather_varlen(values_B.double(), *spread)
        ids = all_gather_varlen(group_ids_B.long(), *spread)
        me = dist.get_rank(spread[0])
        lo = sum(v.numel() for v in vals[:me])
        stats = _group_stats(torch.cat(vals), torch.cat(ids))
        return tuple(t[lo:lo + values_B.numel()].to(values_B.dtype).to(values_B.device) for t in stats)
    return _group_stats(values_B, group_ids_B)


def _group_stats(values_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    _, inv = torch.unique(group_ids_B, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(G, dtype=values_B.dtype, device=values_B.device).index_add_(0, inv, torch.ones_like(values_B))
    total = torch.zeros_like(count).index_add_(0, inv, values_B)
    mean = (total / count)[inv]
    sq = torch.zeros_like(count).index_add_(0, inv, (values_B - mean).square())
    n = count[inv]
    std = torch.sqrt(sq[inv] / (n - 1).clamp_min(1))
    return mean, std, n


def _need_groups(group_ids_B: Tensor | None, name: str) -> Tensor:
    if group_ids_B is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids_B (which prompt each sample answers)")
    return group_ids_B


def _broadcast(adv_B: Tensor, response_mask_BT: Tensor) -> Tensor:
    mask = response_mask_BT.bool()
    return torch.where(mask, adv_B[:, None].expand(mask.shape), torch.zeros(mask.shape, dtype=adv_B.dtype, device=adv_B.device))


def _finish_outcome(adv_B: Tensor, response_mask_BT: Tensor, whiten_batch: bool) -> tuple[Tensor, Tensor]:
    adv = _broadcast(adv_B, response_mask_BT)
    if whiten_batch:
        adv = _whiten(adv, response_mask_BT)
    return adv, adv


@register("advantage", "grpo")
def grpo_advantages(
    token_rewards_BT: Tensor, response_mask_BT: Tensor, *, group_ids_B: Tensor | None = None,
    values_BT: Tensor | None = None, norm_by_std: bool = True, eps: float = GRPO_STD_EPS,
    whiten: bool = False,
) -> tuple[Tensor, Tensor]:
    R = outcome_rewards(token_rewards_BT, response_mask_BT)
    mean, std, n = group_stats(R, _need_groups(group_ids_B, "grpo"))
    adv = R - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(n > 1, adv, torch.zeros_like(adv))
    return _finish_outcome(adv, response_mask_BT, whiten)


@register("advantage", "dr_grpo")
def dr_grpo_advantages(
    token_rewards_BT: Tensor, response_mask_BT: Tensor, *, group_ids_B: Tensor | None = None,
    values_BT: Tensor | None = None, whiten: bool = False,
) -> tuple[Tensor, Tensor]:
    R = outcome_rewards(token_rewards_BT, response_mask_BT)
    mean, _, n = group_stats(R, _need_groups(group_ids_B, "dr_grpo"))
    adv = torch.where(n > 1, R - mean, torch.zeros_like(R))
    return _finish_outcome(adv, response_mask_BT, whiten)


@register("advantage", "rloo")
def rloo_advantages(
    token_rewards_BT: Tensor, response_mask_BT: Tensor, *, group_ids_B: Tensor | None = None,
    values_BT: Tensor | None = None, whiten: bool = False,
) -> tuple[Tensor, Tensor]:
    R = outcome_rewards(token_rewards_BT, response_mask_BT)
    mean, _, n = group_stats(R, _need_groups(group_ids_B, "rloo"))
    adv = torch.where(n > 1, n / (n - 1).clamp_min(1) * (R - mean), torch.zeros_like(R))
    return _finish_outcome(adv, response_mask_BT, whiten)


def discounted_returns(token_rewards_BT: Tensor, response_mask_BT: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ G_{t+1} over valid tokens (reverse scan; invalid positions are skipped)."""
    mask = response_mask_BT.bool()
    r = torch.where(mask, token_rewards_BT, torch.zeros_like(token_rewards_BT))
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return torch.where(mask, out, torch.zeros_like(out))


@register("advantage", "reinforce_pp")
def reinforce_pp_advantages(
    token_rewards_BT: Tensor, response_mask_BT: Tensor, *, group_ids_B: Tensor | None = None,
    values_BT: Tensor | None = None, gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    returns = discounted_returns(token_rewards_BT, response_mask_BT, gamma)
    return whiten(returns, response_mask_BT), returns


@register("advantage", "reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    token_rewards_BT: Tensor, response_mask_BT: Tensor, *, group_ids_B: Tensor | None = None,
    values_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    R = outcome_rewards(token_rewards_BT, response_mask_BT)
    mean, _, _ = group_stats(R, _need_groups(group_ids_B, "reinforce_pp_baseline"))
    return _finish_outcome(R - mean, response_mask_BT, True)


@register("advantage", "gae")
def gae_advantages(
    token_rewards_BT: Tensor, response_mask_BT: Tensor, *, group_ids_B: Tensor | None = None,
    values_BT: Tensor | None = None, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    if values_BT is None:
        raise ValueError("advantage estimator 'gae' needs values_BT (the critic's values)")
    mask = response_mask_BT.bool()
    r = torch.where(mask, token_rewards_BT, torch.zeros_like(token_rewards_BT))
    v = torch.where(mask, values_BT.detach(), torch.zeros_like(r))
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    last_gae = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae_t = delta + gamma * lam * last_gae
        # An invalid position carries the next valid token's value and advantage through.
        next_value = torch.where(mask[:, t], v[:, t], next_value)
        last_gae = torch.where(mask[:, t], gae_t, last_gae)
        adv[:, t] = last_gae
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    returns = torch.where(mask, adv + v, torch.zeros_like(adv))
    if whiten:
        adv = _whiten(adv, mask)
    return adv, returns
