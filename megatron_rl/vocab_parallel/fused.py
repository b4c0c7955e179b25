"""The learner's per-micro-batch entry point: everything about pi from one pass over the shard.

For each token t of the local logit shard [T, V_l] it returns log pi(a_t) (with gradient), the
entropy of pi (optional; with gradient only if asked) and the requested divergences between the
rollout policy mu and pi (ALGORITHMS.md §1, formulas in `divergences.py`):
    binary_tv, binary_kl  from mu(a_t) = exp(rollout_logp) and pi(a_t)
    topk_tv, topk_kl      on S = {a_t} ∪ rollout top-K ids, each id once, plus the rest bucket
The top-K variants only add K gathered logits per token to the pass that log pi(a_t) needs
anyway (the sampled token is column 0 of the gathered ids), which is why they cost about what the
log-prob pass costs: the gathered logits ride in the max all-reduce and the partial sums in the
sum all-reduce that every token chunk needs anyway.
Divergences gate updates, so they are computed without autograd unless divergence_grad=True.
kernel="torch" (the default, the CPU path and the reference) runs `logprobs.py`; kernel="triton"
runs the fused kernels of `triton_kernels.py` (one read of the shard forward, one read + one
gradient write backward, no [chunk, V_l] buffer) with the same cross-shard reductions; triton is
imported only then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .divergences import binary_kl, binary_tv, topk_divergences, topk_support
from .logprobs import DEFAULT_CHUNK_SIZE, vocab_parallel_log_probs_and_entropy

__all__ = ["DIVERGENCES", "KERNELS", "PolicyStats", "vocab_parallel_policy_stats"]

DIVERGENCES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
TOPK_DIVERGENCES = ("topk_tv", "topk_kl")  # need the rollout's top-K log-probs (rollout.top_k_logprobs)
KERNELS = ("torch", "triton")


def resolve_kernel(name: str, device) -> str:
    """learner.loss_kernel as run on `device`: "auto" is the fused Triton kernel on CUDA where
    triton imports (its backward writes the gradient over the logits: no logits-sized buffer, for
    bf16 and fp32 logits alike) and the torch path elsewhere; "torch" and "triton" are themselves."""
    if name != "auto":
        return name
    import importlib.util

    cuda = torch.device(device).type == "cuda"
    return "triton" if cuda and importlib.util.find_spec("triton") is not None else "torch"


@dataclass(frozen=True)
class PolicyStats:
    """Per-token outputs, all shaped like the target ids [...] (fp32, or fp64 for fp64 logits)."""

    logp: torch.Tensor  # log pi(a_t), differentiable w.r.t. the logits
    entropy: torch.Tensor | None = None  # H(pi), differentiable only with entropy_grad=True
    binary_tv: torch.Tensor | None = None
    binary_kl: torch.Tensor | None = None  # KL(mu || pi)
    topk_tv: torch.Tensor | None = None
    topk_kl: torch.Tensor | None = None  # KL(mu || pi)

    def divergence(self, name: str) -> torch.Tensor:
        """The divergence called `name` (one of DIVERGENCES), which must have been requested."""
        if name not in DIVERGENCES:
            raise KeyError(f"unknown divergence {name!r}; valid: {', '.join(DIVERGENCES)}")
        value = getattr(self, name)
        if value is None:
            raise KeyError(f"divergence {name!r} was not requested")
        return value


def vocab_parallel_policy_stats(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    group=None,
    *,
    rollout_logp: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    topk_logp: torch.Tensor | None = None,
    divergences: Sequence[str] = (),
    with_entropy: bool = False,
    entropy_grad: bool = False,
    divergence_grad: bool = False,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    inplace_logits: bool = False,
    topk_distinct: bool = False,
    kernel: str = "torch",
) -> PolicyStats:
    """log pi(a_t), entropy and mu-vs-pi divergences from one pass over the local logit shard.

    logits: [..., V_l] local vocab shard (Megatron layout; bf16/fp32/fp64); target_ids: [...] a_t.
    rollout_logp: [...] log mu(a_t), needed by every divergence. topk_ids / topk_logp: [..., K]
    rollout top-K of mu (global ids, negative = padding), needed by topk_tv / topk_kl.
    group: the tensor-parallel group (None = one process with the whole vocabulary).
    vocab_size: true vocabulary size; ids >= vocab_size are Megatron padding and excluded.
    inplace_logits: overwrite fp32 logits and reuse them as the gradient (Megatron's memory and
    speed trick; see `vocab_parallel_log_probs_and_entropy`); not with entropy_grad.
    topk_distinct: the non-negative ids of each top-K row are known to be distinct (see
    `topk_support`): duplicates are then looked for only between a_t and the list, without a sort.
    kernel: "torch" or "triton" (module docstring). With "triton", chunk_size is unused and
    inplace_logits works for any float dtype and with entropy_grad (the backward writes the
    gradient over the logits, which stay intact until then).
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; valid: {', '.join(KERNELS)}")
    unknown = [d for d in divergences if d not in DIVERGENCES]
    if unknown:
        raise ValueError(f"unknown divergences {unknown}; valid: {', '.join(DIVERGENCES)}")
    if divergences and rollout_logp is None:
        raise ValueError(f"divergences {list(divergences)} need rollout_logp (log mu(a_t))")
    need_topk = any(d.startswith("topk") for d in divergences)
    if need_topk and (topk_ids is None or topk_logp is None):
        raise ValueError("topk_tv / topk_kl need topk_ids and topk_logp from the rollout engine")
    if need_topk:
        ids, keep = topk_support(target_ids, topk_ids, distinct_topk=topk_distinct)  # col 0: a_t
    else:
        ids, keep = target_ids[..., None].long(), None
    # Without divergence_grad only log pi(a_t) (column 0) is differentiated.
    grad_columns = None if divergence_grad else 1
    if kernel == "triton":
        from .triton_kernels import triton_log_probs_and_entropy  # imports triton on first use

        logp_S, ent = triton_log_probs_and_entropy(
            logits, ids, group, temperature=temperature, vocab_size=vocab_size,
            with_entropy=with_entropy, entropy_grad=entropy_grad, inplace_logits=inplace_logits,
            grad_columns=grad_columns,
        )
    else:
        logp_S, ent = vocab_parallel_log_probs_and_entropy(
            logits, ids, group, temperature=temperature, vocab_size=vocab_size,
            chunk_size=chunk_size, with_entropy=with_entropy, entropy_grad=entropy_grad,
            inplace_logits=inplace_logits, grad_columns=grad_columns,
        )
    out: dict[str, torch.Tensor] = {}
    if divergences:
        pi_S = logp_S if divergence_grad else logp_S.detach()
        with torch.set_grad_enabled(divergence_grad and torch.is_grad_enabled()):
            pi_t = pi_S[..., 0]
            if "binary_tv" in divergences:
                out["binary_tv"] = binary_tv(rollout_logp, pi_t)
            if "binary_kl" in divergences:
                out["binary_kl"] = binary_kl(rollout_logp, pi_t)
            if need_topk:
                mu_S = torch.cat([rollout_logp[..., None], topk_logp], dim=-1)
                tv, kl = topk_divergences(mu_S, pi_S, keep, tv="topk_tv" in divergences,
                                          kl="topk_kl" in divergences)
                out.update({k: v for k, v in (("topk_tv", tv), ("topk_kl", kl)) if v is not None})
    return PolicyStats(logp=logp_S[..., 0], entropy=ent, **out)
