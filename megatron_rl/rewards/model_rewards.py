"""Learned-reward-model scores in the RL batch: which tokens the model reads, and how its scores
combine with the rule rewards (`reward_model.*` in the config).

Shapes: B = sequences in the rollout batch, S = positions (right-padded).
"""

from __future__ import annotations

import torch

NORMALIZE = ("none", "batch")
NORMALIZE_EPS = 1e-6


def sequence_attention_mask(loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: 1 on prompt+response tokens, 0 on padding.

    In the trainer's batch (batch/rollout_batch.py) the last response token sits at input position
    P+T−1, one after the last position `loss_mask` marks (P−1 .. P+T−2).
    """
    S = loss_mask_BS.shape[1]
    positions = torch.arange(S, device=loss_mask_BS.device)
    last = torch.where(loss_mask_BS > 0, positions, torch.full_like(positions, -1)).amax(dim=1)
    if bool((last < 0).any()):
        raise ValueError(f"rows {torch.nonzero(last < 0).flatten().tolist()} have no response token")
    return (positions[None, :] <= (last + 1)[:, None]).long()


def combine_rewards(rule_B: torch.Tensor, scores_B: torch.Tensor, *, weight: float, rule_weight: float,
                    normalize: str = "none", clip: float | None = None
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = rule_weight · rule + weight · s, s = the model's scores, whitened over the batch
    (normalize="batch") and clipped to ±clip. Returns (rewards [B] fp32, metrics)."""
    if normalize not in NORMALIZE:
        raise ValueError(f"reward_model.normalize={normalize!r}; valid: {', '.join(NORMALIZE)}")
    scores = scores_B.double()
    s = scores
    if normalize == "batch":
        s = (s - s.mean()) / (s.std(unbiased=False) + NORMALIZE_EPS)
    if clip is not None:
        s = s.clamp(-clip, clip)
    rewards = rule_weight * rule_B.double() + weight * s
    metrics = {"reward/model_mean": float(scores.mean()), "reward/model_std": float(scores.std(unbiased=False)),
               "reward/rule_mean": float(rule_B.double().mean()), "reward/total_mean": float(rewards.mean())}
    return rewards.float(), metrics
