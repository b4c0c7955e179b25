"""Top-K of the current policy pi = softmax(logits / tau) across vocabulary shards.

Each shard takes its local top-K (K' = min(K, real local columns), padded with -inf / id -1),
the group all-gathers those K candidates per shard ([TP, T, K]) and every rank selects the global
top-K from the TP * K candidates: the global top-K is always inside the union of the local ones.
Log-probs come from the same pass (global max and sum-exp by all-reduce). No autograd.
Ties are broken by torch.topk's order over the gathered candidates (rank-major), so equal logits
may pick a different id than a single-process topk would; the log-probs are the same.
"""

from __future__ import annotations

import torch

from .logprobs import DEFAULT_CHUNK_SIZE, _flatten, acc_dtype, forward_pass, temperature_scale
from .shard import all_gather, shard_info

__all__ = ["vocab_parallel_topk"]


@torch.no_grad()
def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    group=None,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [..., k] in descending order, global ids [..., k] int64) of pi's top-k tokens."""
    temperature_scale(logits, temperature)  # validates
    lead = logits.shape[:-1]
    x2d = _flatten(logits)
    T = x2d.shape[0]
    info = shard_info(x2d.shape[1], group, vocab_size)
    if not 0 < k <= info.vocab_size:
        raise ValueError(f"k={k} must be in [1, vocab_size={info.vocab_size}]")
    acc = acc_dtype(x2d.dtype)
    k_loc = min(k, info.n_valid)
    cand_v = torch.full((T, k), float("-inf"), dtype=acc, device=x2d.device)
    cand_i = torch.full((T, k), -1, dtype=torch.long, device=x2d.device)

    def local_topk(r0, r1, xc, _z):  # on the raw logits: monotone in z, no extra buffer
        if k_loc:
            v, i = torch.topk(xc, k_loc, dim=-1)
            cand_v[r0:r1, :k_loc] = v.to(acc)
            cand_i[r0:r1, :k_loc] = i + info.start

    empty_ids = torch.empty(T, 0, dtype=torch.long, device=x2d.device)
    _, lse, _, _ = forward_pass(
        x2d, empty_ids, info, group, float(temperature), chunk_size, False, local_topk
    )
    all_v = torch.cat(all_gather(cand_v, group), dim=-1)  # [T, TP * k]
    all_i = torch.cat(all_gather(cand_i, group), dim=-1)
    top_v, pos = torch.topk(all_v, k, dim=-1)
    ids = all_i.gather(-1, pos)
    logp = top_v * (1.0 / temperature) - lse[:, None]
    return logp.reshape(*lead, k), ids.reshape(*lead, k)
