"""Rollout records -> the learner's global batch, and its mini-batches.

Shapes: B sequences (prompts x samples), S = longest prompt+response, K top-K width,
L MoE layers, k router top-k. Each sequence is `prompt_ids + response_ids`, right-padded.

Alignment: the learner's forward at input position s predicts `labels[s] = input_ids[s+1]`, so the
response token t (sequence position P+t) is predicted at position P−1+t — exactly the row a
RolloutRecord stores for it (records.py). Per-token fields are therefore written at positions
P−1 .. P+T−2 and are zero (masked) elsewhere:
    input_ids, labels          [B, S] int64
    loss_mask                  [B, S] float: 1 on response-token predictions (the response mask)
    rollout_logp               [B, S] float32 log μ(labels[s])
    topk_ids / topk_logp       [B, S, K] (only with top-K log-probs; ids −1 elsewhere); the ids
                               of each row are distinct (checked here, once per step, so that the
                               loss can skip its per-row duplicate search: `topk_distinct`)
    routed_experts             [B, S, L, k] int64 routing of input position s (−1 = none; MoE)
    advantages                 [B, S] float32 (written by the trainer)
    rewards                    [B] float32, group_ids [B] int64, response_len [B], truncated [B]
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_rl.rollout.records import RolloutRecord


def build_batch(records: Sequence[RolloutRecord], rewards: Sequence[float], pad_id: int,
                with_topk: bool, with_routes: bool) -> dict[str, torch.Tensor]:
    B = len(records)
    S = max(r.prompt_ids.numel() + r.response_ids.numel() for r in records)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros(B, S)
    mu = torch.zeros(B, S)
    K = records[0].topk_ids.shape[1] if with_topk else 0
    topk_ids = torch.full((B, S, K), -1, dtype=torch.long) if with_topk else None
    topk_logp = torch.zeros(B, S, K) if with_topk else None
    routes = None
    if with_routes:
        L, k = records[0].routed_experts.shape[1:]
        routes = torch.full((B, S, L, k), -1, dtype=torch.long)
    for i, r in enumerate(records):
        P, T = r.prompt_ids.numel(), r.response_ids.numel()
        ids[i, :P] = r.prompt_ids
        ids[i, P:P + T] = r.response_ids
        rows = slice(P - 1, P - 1 + T)
        mask[i, rows] = 1.0
        mu[i, rows] = r.rollout_logp.float()
        if with_topk:
            topk_ids[i, rows] = r.topk_ids.long()
            topk_logp[i, rows] = r.topk_logp.float()
        if with_routes:
            seq = r.sequence_routed_experts()
            routes[i, : seq.shape[0]] = seq.long()
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = pad_id
    batch = dict(input_ids=ids, labels=labels, loss_mask=mask, rollout_logp=mu,
                 rewards=torch.tensor(list(rewards), dtype=torch.float32),
                 group_ids=torch.tensor([r.prompt_index for r in records], dtype=torch.long),
                 response_len=torch.tensor([r.response_ids.numel() for r in records]),
                 truncated=torch.tensor([r.finish_reason == "length" for r in records]))
    if with_topk:
        check_distinct_topk(topk_ids, records)
        batch.update(topk_ids=topk_ids, topk_logp=topk_logp)
    if with_routes:
        batch["routed_experts"] = routes
    return batch


def check_distinct_topk(topk_ids: torch.Tensor, records: Sequence[RolloutRecord]) -> None:
    """Raise if a top-K row of `topk_ids` [B, S, K] names an id twice (−1 padding aside).

    An inference engine's top-K lists distinct tokens; a repeat means a malformed rollout, and the
    learner's top-K divergences assume there is none (`vocab_parallel_policy_stats(topk_distinct=
    True)`), so it is reported here, naming the sample and the response token.
    """
    srt = topk_ids.sort(dim=-1).values
    rep = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if not bool(rep.any()):
        return
    i, s, k = (int(v) for v in rep.nonzero()[0])
    r = records[i]
    t = s - (r.prompt_ids.numel() - 1)
    raise ValueError(
        f"rollout sample (prompt {r.prompt_index}, sample {r.sample_index}): the top-K ids of "
        f"response token {t} name id {int(srt[i, s, k])} twice ({topk_ids[i, s].tolist()}); an "
        "inference engine's top-K lists distinct tokens")


def token_rewards(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, S]: each outcome reward on its sequence's last response-token prediction."""
    mask = batch["loss_mask"]
    last = (mask * torch.arange(mask.shape[1], dtype=mask.dtype)).argmax(dim=1)
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last] = batch["rewards"]
    return out


PER_SEQUENCE = ("rewards", "group_ids", "response_len", "truncated")


def mini_batches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    """Split the global batch into n contiguous mini-batches of whole prompt groups."""
    B = batch["input_ids"].shape[0]
    if B % n:
        raise ValueError(f"{B} sequences do not split into algorithm.mini_batches = {n}")
    size = B // n
    return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(n)]
