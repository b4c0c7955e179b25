"""Loss aggregation over tokens with a global normaliser (ALGORITHMS.md §6).

A step's batch is split into micro-batches and data-parallel shards. Each piece contributes
(its sum) / N, where N is the normaliser counted over the *whole* step — every micro-batch of
every DP rank — so the pieces add up to exactly the full-batch loss whatever the layout.
`local_count` gives one piece's share of N; `adapter.global_normalizer` sums it over micro-batches
and all-reduces it over the DP group.

Modes (ℓ = per-token loss [B, T], m = response mask, n_i = Σ_t m_{i,t}):
- token-mean:              Σ_{i,t} m·ℓ / N_tokens
- seq-mean-token-sum:      Σ_i Σ_t m·ℓ / N_seqs
- seq-mean-token-mean:     Σ_i (Σ_t m·ℓ / n_i) / N_seqs
- seq-mean-token-sum-norm: Σ_i Σ_t m·ℓ / (N_seqs · L_const), L_const = max response length
  (Dr.GRPO: a constant, not the sequence's length).
N_tokens = number of valid tokens; N_seqs = number of sequences with at least one valid token
(an all-masked sequence, e.g. an overlong-filtered one, contributes nothing and is not counted).
A zero normaliser (nothing valid anywhere) gives loss 0, not NaN.
"""

from __future__ import annotations

import torch

from .registry import get, register

Tensor = torch.Tensor

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")


def local_count(response_mask_BT: Tensor, mode: str) -> Tensor:
    """This piece's share of the normaliser (int64 scalar): valid tokens for token-mean, non-empty
    sequences for the seq-mean modes."""
    _check_mode(mode)
    mask = response_mask_BT.bool()
    if mode == "token-mean":
        return mask.sum().to(torch.int64)
    if mask.dim() != 2:
        raise ValueError(f"{mode} needs a [B, T] mask (got shape {tuple(mask.shape)})")
    return mask.any(dim=-1).sum().to(torch.int64)


def _denominator(normalizer, like: Tensor) -> Tensor:
    return torch.as_tensor(normalizer, dtype=like.dtype, device=like.device).clamp_min(1)


def _masked(loss_BT: Tensor, response_mask_BT: Tensor) -> Tensor:
    if loss_BT.shape != response_mask_BT.shape:
        raise ValueError(f"loss shape {tuple(loss_BT.shape)} != mask shape {tuple(response_mask_BT.shape)}")
    return torch.where(response_mask_BT.bool(), loss_BT, torch.zeros_like(loss_BT))


@register("aggregation", "token-mean")
def token_mean(loss_BT: Tensor, response_mask_BT: Tensor, *, normalizer, max_response_length=None) -> Tensor:
    return _masked(loss_BT, response_mask_BT).sum() / _denominator(normalizer, loss_BT)


@register("aggregation", "seq-mean-token-sum")
def seq_mean_token_sum(loss_BT: Tensor, response_mask_BT: Tensor, *, normalizer, max_response_length=None) -> Tensor:
    return _masked(loss_BT, response_mask_BT).sum() / _denominator(normalizer, loss_BT)


@register("aggregation", "seq-mean-token-mean")
def seq_mean_token_mean(loss_BT: Tensor, response_mask_BT: Tensor, *, normalizer, max_response_length=None) -> Tensor:
    n_B = response_mask_BT.bool().sum(dim=-1).clamp_min(1).to(loss_BT.dtype)
    per_seq = _masked(loss_BT, response_mask_BT).sum(dim=-1) / n_B
    return per_seq.sum() / _denominator(normalizer, loss_BT)


@register("aggregation", "seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_BT: Tensor, response_mask_BT: Tensor, *, normalizer, max_response_length=None) -> Tensor:
    if max_response_length is None or max_response_length <= 0:
        raise ValueError("seq-mean-token-sum-norm needs max_response_length (the constant L of Dr.GRPO)")
    total = _masked(loss_BT, response_mask_BT).sum()
    return total / (_denominator(normalizer, loss_BT) * float(max_response_length))


def aggregate(loss_BT: Tensor, response_mask_BT: Tensor, mode: str, *, normalizer,
              max_response_length: int | None = None) -> Tensor:
    """This piece's contribution to the step loss (a scalar); `normalizer` is the global count."""
    _check_mode(mode)
    return get("aggregation", mode)(loss_BT, response_mask_BT, normalizer=normalizer,
                                    max_response_length=max_response_length)
