"""Log-probs, entropy and mu-vs-pi divergences over vocabulary-sharded logits (torch + collectives).

Every function takes the local logit shard [..., V/TP] and the tensor-parallel process group
explicitly (None = one process, full vocabulary); the shard's first global id is
rank * V_local (Megatron's contiguous sharding of the padded vocabulary). Nothing here ever
materialises a full-vocabulary tensor. Formulas: ALGORITHMS.md §1 and the module docstrings of
`logprobs`, `divergences`, `topk`, `fused` and `triton_kernels` (the fused Triton kernels
behind `vocab_parallel_policy_stats(kernel="triton")`; triton is imported only when used).
"""

from .divergences import (
    BINARY_EPS,
    REST_CLAMP,
    binary_kl,
    binary_tv,
    topk_divergences,
    topk_kl,
    topk_support,
    topk_tv,
    vocab_parallel_full_divergence,
    vocab_parallel_topk_divergence,
)
from .fused import DIVERGENCES, KERNELS, TOPK_DIVERGENCES, PolicyStats, resolve_kernel, vocab_parallel_policy_stats
from .logprobs import (
    DEFAULT_CHUNK_SIZE,
    temperature_scale,
    vocab_parallel_entropy,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)
from .shard import ShardInfo, shard_info, vocab_range
from .topk import vocab_parallel_topk

__all__ = [
    "BINARY_EPS",
    "DEFAULT_CHUNK_SIZE",
    "DIVERGENCES",
    "KERNELS",
    "TOPK_DIVERGENCES",
    "PolicyStats",
    "resolve_kernel",
    "REST_CLAMP",
    "ShardInfo",
    "binary_kl",
    "binary_tv",
    "shard_info",
    "temperature_scale",
    "topk_kl",
    "topk_divergences",
    "topk_support",
    "topk_tv",
    "vocab_parallel_entropy",
    "vocab_parallel_full_divergence",
    "vocab_parallel_log_probs",
    "vocab_parallel_log_probs_and_entropy",
    "vocab_parallel_policy_stats",
    "vocab_parallel_topk",
    "vocab_parallel_topk_divergence",
    "vocab_range",
]
