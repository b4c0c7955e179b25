"""Loss closures for the learner (RL policy losses plug in beside these).

A closure has the learner's signature `(logits_BSV, mb, tp_group, vocab_size) -> (loss, metrics)`
with `logits_BSV` this rank's shard of the (padded) vocabulary; log-probs come from the
vocab-parallel module, which excludes Megatron's padded vocabulary columns.
"""

from __future__ import annotations

import torch

from megatron_rl.batch.packing import per_token, unpacked
from megatron_rl.vocab_parallel import vocab_parallel_log_probs


def token_logprobs(logits_BSV, labels_BS, tp_group, vocab_size: int):
    """log softmax(logits)[label] per position, fp32, differentiable, never gathering the vocab.

    The learner's logits are read by nothing after the loss, so fp32 logits are overwritten in
    place and their storage becomes the gradient (Megatron's trick): no [T, V/TP] scratch and no
    recompute of the softmax in backward (docs/benchmarks.md). bf16 logits take the chunked path.
    """
    return vocab_parallel_log_probs(logits_BSV, labels_BS.long(), tp_group, vocab_size=vocab_size,
                                    inplace_logits=logits_BSV.dtype == torch.float32)


def masked_nll_loss(logits_BSV, mb, tp_group, vocab_size, *, denom: float):
    """Σ_masked −log π(label) / denom, with denom the global count of masked tokens."""
    logp = unpacked(mb, token_logprobs(logits_BSV, per_token(mb, "labels"), tp_group, vocab_size))
    mask = mb["loss_mask"].float()
    nll_sum = -(logp * mask).sum()
    return nll_sum / denom, {"loss": nll_sum.detach() / denom, "tokens": mask.sum()}
