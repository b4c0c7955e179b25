"""Scalar output head for Megatron GPTModel: value models (critics) and reward models.

Shapes: s = sequence length, b = micro-batch, h = hidden size, TP = tensor-parallel size.

`build_scalar_head_chunks` builds this pipeline rank's GPTModel chunks like
`bridge.build_model_chunks`, but the chunk that holds the last stage's output layer gets a
`ScalarHead` (h -> 1) in place of the LM head (ColumnParallelLinear h -> V/TP), so GPTModel's
forward returns [b, s, 1] fp32 instead of vocab logits. Earlier pipeline stages are unchanged
(only the last stage has an output layer).

Weights: the decoder comes from the HF checkpoint through mbridge; the LM head is removed before
loading, so a checkpoint without `lm_head.weight` (`*ForSequenceClassification`) loads. The head is
the checkpoint's `score.weight` [1, h] (a reward model, or a critic initialised from one) or fresh:
N(0, std²) from a fixed seed, drawn on CPU so it is identical on every rank (std defaults to the
HF config's `initializer_range`, what transformers gives a new `score` layer).

Sequence parallel: the final-norm hidden states reaching the output layer are sharded along the
sequence, [s/TP, b, h]. The head all-gathers them to [s, b, h] and every TP rank applies the same
replicated weight, so every TP rank computes the same full loss. Hence the gradient w.r.t. the
gathered states is the same on all TP ranks and the gather's backward only *splits* it
(`tensor_parallel_output_grad=False`), and the head's weight gradient is already complete on every
TP rank: it is not TP-reduced (no `sequence_parallel` attribute) and, not being
`tensor_model_parallel`, counts once (TP rank 0) in Megatron's grad norm.

Tied embeddings (`tie_word_embeddings`): the head is not the embedding, so every chunk gets
`share_embeddings_and_output_weights = False`; Megatron then neither feeds the embedding to the
output layer nor all-reduces it between the first and last pipeline stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.distributed.context import ParallelContext
from megatron_rl.models.bridge import build_model_chunks, load_hf_weights

HEAD_INITS = ("auto", "checkpoint", "fresh")
SCORE_WEIGHT = "score.weight"  # transformers' *ForSequenceClassification head


class ScalarHead(torch.nn.Module):
    """GPTModel's output layer replaced by h -> 1: [s(/TP), b, h] -> ([s, b, 1] fp32, None)."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, tp_group, device: torch.device):
        super().__init__()
        from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, device=device))
        set_defaults_if_not_set_tensor_model_parallel_attributes(self.weight)
        # GPTModel reads `output_layer.sequence_parallel` (and may switch it off around an
        # inference gather it does itself).
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_SBH: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        # `weight` (a tied embedding) and `runtime_gather_output` belong to the LM head's call
        # signature; neither applies to a replicated scalar head.
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_SBH = gather_from_sequence_parallel_region(
                hidden_SBH, tensor_parallel_output_grad=False, group=self.tp_group)
        # fp32 head: values/rewards are regressed and compared at fp32 precision under bf16 too.
        return torch.nn.functional.linear(hidden_SBH.float(), self.weight.float()), None


def read_hf_tensor(hf_path: str | Path, name: str) -> Optional[torch.Tensor]:
    """One tensor of a safetensors HF checkpoint (sharded or not), or None if it has none."""
    from safetensors import safe_open

    hf_path = Path(hf_path)
    index = hf_path / "model.safetensors.index.json"
    if index.exists():
        shard = json.loads(index.read_text())["weight_map"].get(name)
        files = [hf_path / shard] if shard else []
    else:
        files = sorted(hf_path.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            if name in fh.keys():
                return fh.get_tensor(name)
    return None


def _head_weight(hf_path, hidden: int, head_init: str, init_std: float, seed: int) -> torch.Tensor:
    if head_init not in HEAD_INITS:
        raise ValueError(f"head_init={head_init!r}; valid: {', '.join(HEAD_INITS)}")
    score = None if head_init == "fresh" else read_hf_tensor(hf_path, SCORE_WEIGHT)
    if score is None:
        if head_init == "checkpoint":
            raise ValueError(f"{hf_path} has no {SCORE_WEIGHT} (not a *ForSequenceClassification "
                             "checkpoint); use head_init='fresh' for a new head")
        g = torch.Generator().manual_seed(seed)
        return torch.randn(1, hidden, generator=g, dtype=torch.float32) * init_std
    if tuple(score.shape) != (1, hidden):
        raise ValueError(f"{hf_path}: {SCORE_WEIGHT} has shape {tuple(score.shape)}; a scalar head "
                         f"needs (1, {hidden}) (num_labels = 1)")
    if read_hf_tensor(hf_path, "score.bias") is not None:
        raise NotImplementedError(f"{hf_path}: a score head with a bias is not supported")
    return score.float()


def build_scalar_head_chunks(bridge, ctx: ParallelContext, hf_path: str | Path, *,
                             head_init: str = "auto", init_std: Optional[float] = None,
                             seed: int = 0) -> list[torch.nn.Module]:
    """GPTModel chunks of this pipeline rank with a scalar head on the last stage, weights loaded.

    `head_init`: "checkpoint" (the checkpoint's `score.weight`, required), "fresh" (N(0, init_std²)
    from `seed`), or "auto" (the checkpoint's head if it has one, else fresh). `init_std` defaults
    to the HF config's `initializer_range`. Collective over the TP / expert-TP groups (loading).
    """
    chunks = build_model_chunks(bridge, ctx)
    last = [c for c in chunks if c.post_process]
    for c in chunks:
        c.share_embeddings_and_output_weights = False
    for c in last:
        c.output_layer = None  # the LM head goes before loading: mbridge must not look for it
    load_hf_weights(bridge, chunks, hf_path)
    if last:
        hidden = bridge.hf_config.hidden_size
        std = getattr(bridge.hf_config, "initializer_range", 0.02) if init_std is None else init_std
        weight = _head_weight(hf_path, hidden, head_init, std, seed)
        for c in last:
            c.output_layer = ScalarHead(hidden, sequence_parallel=ctx.sequence_parallel,
                                        tp_group=ctx.tp_group, device=ctx.device)
            with torch.no_grad():
                c.output_layer.weight.copy_(weight)
    return chunks
