"""Tiny random-weight Qwen3 sequence-classification checkpoints (reward models) made locally.

The reward-model counterpart of `tiny.py` (same config helper, same character tokenizer): a
`Qwen3ForSequenceClassification` with `num_labels` outputs, whose `score.weight` [num_labels,
hidden] reads the final-norm hidden state. HF pools it at the last non-pad token of each sequence
(Bradley–Terry reward models use num_labels = 1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from megatron_rl.models.tiny import _common_config, build_char_tokenizer


def make_tiny_reward_checkpoint(
    path: str | Path,
    *,
    num_labels: int = 1,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    ffn: int = 128,
    vocab_size: int = 256,
    max_positions: int = 512,
    init_std: float = 0.02,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write a tiny `Qwen3ForSequenceClassification` HF checkpoint to `path`; return it.

    `score.weight` is drawn with std 1/sqrt(hidden) (not `init_std`) so rewards are O(1) and an
    absolute comparison at 1e-4 is a real test; RMSNorm weights are perturbed as in `tiny.py`.
    Idempotent: an existing checkpoint made with the same arguments is reused.
    """
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    path = Path(path)
    args = dict(kind="qwen3_seq_cls", num_labels=num_labels, num_layers=num_layers, hidden=hidden,
                heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn, vocab_size=vocab_size,
                max_positions=max_positions, init_std=init_std,
                tie_word_embeddings=tie_word_embeddings, seed=seed)
    stamp = path / "megatron_rl_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()) == args:
        return path

    tokenizer = build_char_tokenizer()
    assert len(tokenizer) <= vocab_size, (len(tokenizer), vocab_size)
    common = _common_config(vocab_size, num_layers, hidden, heads, kv_heads, head_dim,
                            max_positions, tokenizer)
    common["tie_word_embeddings"] = tie_word_embeddings
    config = Qwen3Config(**common, intermediate_size=ffn, initializer_range=init_std,
                         num_labels=num_labels,
                         architectures=["Qwen3ForSequenceClassification"])
    torch.manual_seed(seed)
    model = Qwen3ForSequenceClassification(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        model.score.weight.normal_(0.0, 1.0 / math.sqrt(hidden))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    stamp.write_text(json.dumps(args))
    return path
