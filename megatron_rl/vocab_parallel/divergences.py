"""Divergences between the rollout policy mu and the current policy pi (ALGORITHMS.md §1).

Shapes: T tokens (any leading dims), K rollout top-K width, J = K + 1 ids of the support
S = {a_t} ∪ topK_mu (column 0 is the sampled token a_t), V the vocabulary.

Binary (partition {a_t, rest}); mu = mu(a_t), p = pi(a_t):
    TV = |mu - p|
    KL = mu log(mu / p) + (1 - mu) log((1 - mu) / (1 - p))     KL(mu || pi)
    1 - q is formed as -expm1(log q) (exact near q = 1) and log(1 - q) as log1mexp(log q),
    floored at log(eps) (eps = 1e-12), so q -> 1 neither divides by zero nor loses digits.
Top-K (partition S ∪ {rest}), each id counted once (duplicates and negative padding ids dropped):
    rest_x = max(1 - sum_{k in S} x_k, 1e-12)   for x in {mu, pi}
    TV = 1/2 (sum_{k in S} |mu_k - pi_k| + |rest_mu - rest_pi|)
    KL = sum_{k in S} mu_k (log mu_k - log pi_k) + rest_mu (log rest_mu - log rest_pi)
Full (every id its own cell), p = softmax(a / tau), q = softmax(b / tau), both vocab-sharded:
    TV = 1/2 sum_i |p_i - q_i|,   KL(p || q) = sum_i p_i (log p_i - log q_i)
Coarser partitions never increase TV or KL, so binary <= top-K <= full for a real mu.
KL values are clamped at 0 and TV values into [0, 1]: anything outside is rounding.

The binary and top-K functions are pure tensor functions of log-probs and are differentiable if
their inputs are; the vocab-parallel wrappers (and the fused entry point) compute them under
no_grad unless asked, because in DPPO the divergence only gates which tokens get a gradient.
The full divergences are metrics/ablations and are never differentiable.
"""

from __future__ import annotations

import math

import torch

from .logprobs import (
    DEFAULT_CHUNK_SIZE,
    _flatten,
    _row_blocks,
    acc_dtype,
    check_chunk,
    temperature_scale,
    vocab_parallel_log_probs,
)
from .shard import all_reduce_, shard_info

__all__ = [
    "REST_CLAMP",
    "BINARY_EPS",
    "binary_tv",
    "binary_kl",
    "topk_support",
    "topk_divergences",
    "topk_tv",
    "topk_kl",
    "vocab_parallel_topk_divergence",
    "vocab_parallel_full_divergence",
]

REST_CLAMP = 1e-12
BINARY_EPS = 1e-12


def _promote(*xs: torch.Tensor) -> list[torch.Tensor]:
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32
    return [x.to(dtype) for x in xs]


def log1mexp(logq: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(logq)) for logq <= 0, accurate at both ends (Mächler 2012)."""
    logq = logq.clamp(max=0.0)
    near_one = logq > -math.log(2.0)
    # Evaluate each branch on a safe argument so the unused branch never produces inf/nan
    # (which would poison gradients through torch.where).
    a = torch.where(near_one, logq, torch.full_like(logq, -1.0))
    b = torch.where(near_one, torch.full_like(logq, -1.0), logq)
    return torch.where(near_one, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(b)))


def binary_tv(mu_logp: torch.Tensor, pi_logp: torch.Tensor) -> torch.Tensor:
    """|mu(a_t) - pi(a_t)| from the two log-probs of the sampled token."""
    mu_logp, pi_logp = _promote(mu_logp, pi_logp)
    return (torch.exp(mu_logp) - torch.exp(pi_logp)).abs().clamp(max=1.0)


def binary_kl(mu_logp: torch.Tensor, pi_logp: torch.Tensor, eps: float = BINARY_EPS) -> torch.Tensor:
    """KL(mu || pi) on the partition {a_t, rest} from the two log-probs of the sampled token."""
    mu_logp, pi_logp = _promote(mu_logp, pi_logp)
    mu_logp = mu_logp.clamp(max=0.0)
    pi_logp = pi_logp.clamp(max=0.0)
    log_eps = math.log(eps)
    mu = torch.exp(mu_logp)
    one_m_mu = -torch.expm1(mu_logp)
    log_1m_mu = log1mexp(mu_logp).clamp(min=log_eps)
    log_1m_pi = log1mexp(pi_logp).clamp(min=log_eps)
    hit = torch.where(mu > 0, mu * (mu_logp - pi_logp), torch.zeros_like(mu))
    return (hit + one_m_mu * (log_1m_mu - log_1m_pi)).clamp(min=0.0)


def topk_support(
    sampled_ids: torch.Tensor, topk_ids: torch.Tensor, *, distinct_topk: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """S = {a_t} ∪ topK as ids [..., K + 1] (column 0 = a_t) and a mask [..., K + 1] that keeps
    each id once (its first column) and drops negative ids (padding of a short top-K list).

    distinct_topk: the caller guarantees that the non-negative ids of each top-K row are distinct
    (an inference engine's top-K always is; `trainer.batch.RolloutBatch.from_records` checks it once per step).
    Only the entry equal to a_t can then repeat an id: one O(K) compare per row replaces the sort.
    """
    ids = torch.cat([sampled_ids[..., None], topk_ids], dim=-1).long()
    if distinct_topk:
        keep = ids >= 0
        keep[..., 1:] &= ids[..., 1:] != ids[..., :1]
        return ids, keep
    # A stable sort puts equal ids next to each other in column order: every one but the first of
    # a run is a duplicate. O(J log J) per row (the pairwise [.., J, J] compare cost 2-3x more).
    srt, perm = ids.sort(dim=-1, stable=True)
    dup_sorted = torch.zeros_like(srt, dtype=torch.bool)
    torch.eq(srt[..., 1:], srt[..., :-1], out=dup_sorted[..., 1:])
    dup = torch.empty_like(dup_sorted).scatter_(-1, perm, dup_sorted)
    return ids, (ids >= 0) & ~dup


def topk_divergences(
    mu_logp_S: torch.Tensor, pi_logp_S: torch.Tensor, keep_S: torch.Tensor,
    *, tv: bool = True, kl: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(top-K TV, top-K KL(mu || pi)) from log-probs on the support S (see `topk_support`); the
    one not asked for is None. Both share one set of probabilities and rest buckets."""
    mu_logp_S, pi_logp_S = _promote(mu_logp_S, pi_logp_S)
    neg_inf = torch.full((), float("-inf"), dtype=mu_logp_S.dtype, device=mu_logp_S.device)
    # Dropped columns become probability 0 on both sides; the safe values keep gradients finite.
    mu_lp = torch.where(keep_S, mu_logp_S, neg_inf)
    pi_lp = torch.where(keep_S, pi_logp_S, neg_inf)
    mu = torch.exp(mu_lp)
    pi = torch.exp(pi_lp)
    rest_mu = (1.0 - mu.sum(-1)).clamp(min=REST_CLAMP)
    rest_pi = (1.0 - pi.sum(-1)).clamp(min=REST_CLAMP)
    out_tv = out_kl = None
    if tv:
        out_tv = (0.5 * ((mu - pi).abs().sum(-1) + (rest_mu - rest_pi).abs())).clamp(0.0, 1.0)
    if kl:
        # mu_k (log mu_k - log pi_k) over the columns with mu_k > 0 (elsewhere the log ratio may
        # be nan, -inf - -inf, and the term is 0).
        ratio = torch.where(mu > 0, mu_lp - pi_lp, torch.zeros((), dtype=mu.dtype))
        hit = torch.linalg.vecdot(mu, ratio)
        out_kl = (hit + rest_mu * (torch.log(rest_mu) - torch.log(rest_pi))).clamp(min=0.0)
    return out_tv, out_kl


def topk_tv(mu_logp_S: torch.Tensor, pi_logp_S: torch.Tensor, keep_S: torch.Tensor) -> torch.Tensor:
    """Top-K TV from log-probs on the support S (see `topk_support`)."""
    return topk_divergences(mu_logp_S, pi_logp_S, keep_S, kl=False)[0]


def topk_kl(mu_logp_S: torch.Tensor, pi_logp_S: torch.Tensor, keep_S: torch.Tensor) -> torch.Tensor:
    """Top-K KL(mu || pi) from log-probs on the support S (see `topk_support`)."""
    return topk_divergences(mu_logp_S, pi_logp_S, keep_S, tv=False)[1]


def vocab_parallel_topk_divergence(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_logp: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logp: torch.Tensor,
    group=None,
    *,
    kind: str = "tv",
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    requires_grad: bool = False,
) -> torch.Tensor:
    """Top-K TV or KL(mu || pi) [...] with pi = softmax(logits / temperature) over the shards.

    sampled_ids, rollout_logp: [...]; topk_ids, topk_logp: [..., K] (rollout engine's top-K of mu,
    global ids). Differentiable w.r.t. logits only if requires_grad.
    """
    if kind not in ("tv", "kl"):
        raise ValueError(f"kind must be 'tv' or 'kl', got {kind!r}")
    ids_S, keep_S = topk_support(sampled_ids, topk_ids)
    mu_S = torch.cat([rollout_logp[..., None], topk_logp], dim=-1)
    with torch.set_grad_enabled(requires_grad and torch.is_grad_enabled()):
        pi_S = vocab_parallel_log_probs(
            logits, ids_S, group, temperature=temperature, vocab_size=vocab_size,
            chunk_size=chunk_size,
        )
        return (topk_tv if kind == "tv" else topk_kl)(mu_S, pi_S, keep_S)


@torch.no_grad()
def vocab_parallel_full_divergence(
    logits_p: torch.Tensor,
    logits_q: torch.Tensor,
    group=None,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(TV(p, q), KL(p || q)) [...] between two identically sharded logit tensors [..., V_l].

    p = softmax(logits_p / temperature), q likewise. No autograd (metrics and ablations).
    Memory: the [chunk, V_l] scratch buffer is split into p and q halves of chunk/2 rows.
    """
    if logits_p.shape != logits_q.shape:
        raise ValueError(f"shapes differ: {tuple(logits_p.shape)} vs {tuple(logits_q.shape)}")
    temperature_scale(logits_p, temperature)  # validates
    lead = logits_p.shape[:-1]
    a2d, b2d = _flatten(logits_p), _flatten(logits_q)
    T = a2d.shape[0]
    info = shard_info(a2d.shape[1], group, vocab_size)
    nv = info.n_valid
    acc = acc_dtype(torch.promote_types(a2d.dtype, b2d.dtype))
    alpha = 1.0 / temperature
    rows = max(1, min(check_chunk(chunk_size) // 2, T))
    buf = torch.empty(2, rows, nv, dtype=acc, device=a2d.device)
    tv = torch.empty(T, dtype=acc, device=a2d.device)
    kl = torch.empty(T, dtype=acc, device=a2d.device)
    for r0, r1 in _row_blocks(T, rows):
        r = r1 - r0
        ac, bc = a2d[r0:r1, :nv], b2d[r0:r1, :nv]
        m = torch.full((2, r), float("-inf"), dtype=acc, device=a2d.device)
        if nv:
            m[0], m[1] = ac.amax(-1), bc.amax(-1)
        all_reduce_(m, "max", group)
        m_a = m * alpha
        P, Q = buf[0, :r], buf[1, :r]
        s = torch.empty(2, r, dtype=acc, device=a2d.device)
        torch.add(-m_a[0, :, None], ac, alpha=alpha, out=P)
        s[0] = P.exp_().sum(-1)
        torch.add(-m_a[1, :, None], bc, alpha=alpha, out=Q)
        s[1] = Q.exp_().sum(-1)
        all_reduce_(s, "sum", group)
        log_s = torch.log(s)
        P.div_(s[0, :, None])  # p
        Q.div_(s[1, :, None])  # q
        parts = torch.empty(2, r, dtype=acc, device=a2d.device)
        parts[0] = torch.linalg.vector_norm(Q.sub_(P), ord=1, dim=-1)  # sum |q - p|, no temporary
        # log p - log q = (a - b) * alpha - (lse_a - lse_b), formed from the logits so that
        # underflowed probabilities still get an exact log ratio (and p = q gives exactly 0).
        d_lse = (m_a[0] + log_s[0]) - (m_a[1] + log_s[1])
        Q.copy_(ac).sub_(bc).mul_(alpha).sub_(d_lse[:, None])
        parts[1] = torch.bmm(P[:, None, :], Q[:, :, None]).view(r)
        all_reduce_(parts, "sum", group)
        tv[r0:r1] = 0.5 * parts[0]
        kl[r0:r1] = parts[1]
    return tv.clamp(0.0, 1.0).reshape(lead), kl.clamp(min=0.0).reshape(lead)
