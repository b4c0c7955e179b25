"""Token log-probs over vocab-sharded logits and the masked token-NLL loss closure.

Shapes: B sequences, S positions, V vocabulary (padded), local shard V/TP. Megatron pads the
vocabulary to a multiple of 128·TP; padded columns are not tokens and are excluded (-inf) so that
log-probs equal the unpadded model's (and the rollout engine's) at every TP size.
"""

from __future__ import annotations

import torch


def mask_padded_vocab(logits_BSV: torch.Tensor, tp_group, vocab_size: int) -> torch.Tensor:
    """Set columns of the padded vocabulary (global id >= vocab_size) to -inf on this shard."""
    local = logits_BSV.shape[-1]
    rank = tp_group.rank() if tp_group is not None else 0
    first = rank * local
    n_real = max(0, min(local, vocab_size - first))
    if n_real == local:
        return logits_BSV
    keep = torch.arange(local, device=logits_BSV.device) < n_real
    return logits_BSV.masked_fill(~keep, float("-inf"))


def token_logprobs(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, tp_group, vocab_size: int) -> torch.Tensor:
    """log softmax(logits)[label] per position, fp32, differentiable, without gathering the vocab."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(logits_BSV.float(), tp_group, vocab_size)
    # vocab_parallel_cross_entropy works on the shard with max / sum-exp all-reduced over TP.
    return -vocab_parallel_cross_entropy(logits.contiguous(), labels_BS.long())


def masked_nll_loss(logits_BSV, mb, tp_group, vocab_size, *, denom: float):
    """Σ_masked −log π(label) / denom, with denom the global count of masked tokens."""
    logp = token_logprobs(logits_BSV, mb["labels"], tp_group, vocab_size)
    mask = mb["loss_mask"].float()
    nll_sum = -(logp * mask).sum()
    return nll_sum / denom, {"loss": nll_sum.detach() / denom, "tokens": mask.sum()}
