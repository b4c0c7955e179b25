"""The learner layout against the model: what Megatron-Core would refuse after the launch, said before.

A layout that does not divide the model fails only once the job runs (on Slurm: after the queue
and the nodes' start-up), in Megatron-Core's TransformerConfig or in a linear layer's `divide`.
`layout_problems` states the same rules on the model's shape, read from its HF `config.json` (or
the tiny model's config when the run builds one), so `dry-run` and `train` refuse it at once:

- attention heads and KV heads (query groups) divisible by TP (TransformerConfig.__post_init__);
- the dense MLP width divisible by TP (ColumnParallelLinear's `divide`);
- layers divisible by PP, and each stage's layers by VPP (TransformerConfig's pipeline split; the
  project sets no uneven first/last stage);
- experts divisible by EP (MoELayer), the expert MLP width by ETP.
The vocabulary needs no rule: Megatron pads it to a multiple of make_vocab_size_divisible_by x TP.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Architecture:
    source: str  # where the shape was read
    layers: Optional[int]  # None: not in config.json (its rules are skipped)
    heads: Optional[int]
    kv_heads: Optional[int]
    ffn: Optional[int]  # dense MLP width (None: every layer is MoE)
    experts: int  # 0: dense
    moe_ffn: Optional[int]


def architecture(model) -> Optional[Architecture]:
    """The shape of `model` (ModelConfig): its hf_path's config.json, or `model.tiny` when the run
    builds the tiny model (or a base model from it). None when hf_path has no config.json yet."""
    if model.hf_path is None:
        t = model.tiny
        return Architecture("model.tiny", t.num_layers, t.heads, t.kv_heads, None if t.moe else t.ffn,
                            t.num_experts if t.moe else 0, t.moe_ffn if t.moe else None)
    path = Path(model.hf_path) / "config.json"
    if not path.is_file():
        return None
    c = json.loads(path.read_text())
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    all_moe = experts and c.get("decoder_sparse_step", 1) == 1 and not c.get("mlp_only_layers")
    heads = c.get("num_attention_heads")
    return Architecture(str(path), c.get("num_hidden_layers"), heads, c.get("num_key_value_heads") or heads,
                        None if all_moe else c.get("intermediate_size"), experts,
                        c.get("moe_intermediate_size") if experts else None)


def layout_problems(arch: Architecture, parallel) -> list[str]:
    """Every rule of the module docstring that `parallel` (ParallelConfig) breaks for `arch`."""
    tp, pp, ep, etp = parallel.tp, parallel.pp, parallel.ep, parallel.etp or 1
    vpp = parallel.vpp if parallel.vpp and parallel.vpp > 1 else 1
    out = []
    if arch.heads and arch.heads % tp:
        out.append(f"parallel.tp={tp}: {arch.heads} attention heads are not divisible by it")
    if arch.kv_heads and arch.kv_heads % tp:
        out.append(f"parallel.tp={tp}: {arch.kv_heads} key/value heads (query groups) are not divisible by it")
    if arch.ffn and arch.ffn % tp:
        out.append(f"parallel.tp={tp}: the MLP width {arch.ffn} is not divisible by it")
    if arch.layers and arch.layers % pp:
        out.append(f"parallel.pp={pp}: {arch.layers} layers are not divisible by it")
    elif arch.layers and vpp > 1 and (arch.layers // pp) % vpp:
        out.append(f"parallel.vpp={vpp}: {arch.layers // pp} layers per pipeline stage are not divisible by it")
    if arch.experts:
        if arch.experts % ep:
            out.append(f"parallel.ep={ep}: {arch.experts} experts are not divisible by it")
        if arch.moe_ffn and arch.moe_ffn % etp:
            out.append(f"parallel.etp={etp}: the expert MLP width {arch.moe_ffn} is not divisible by it")
    elif ep > 1:
        out.append(f"parallel.ep={ep}: the model has no experts (dense); use parallel.ep=1")
    return out


def check_layout(model, parallel) -> Optional[Architecture]:
    """Raise ValueError naming every problem of `parallel` for `model`; return the shape read."""
    arch = architecture(model)
    if arch is None:
        return None
    problems = layout_problems(arch, parallel)
    if problems:
        shape = (f"{arch.layers} layers, {arch.heads} heads / {arch.kv_heads} KV heads"
                 + (f", {arch.experts} experts" if arch.experts else "") + f"; from {arch.source}")
        raise ValueError("the parallel layout does not fit the model (" + shape + "):\n  " + "\n  ".join(problems))
    return arch


def parameter_count(model) -> Optional[int]:
    """The model's parameters, from its HF config.json (Qwen3 / Qwen3-MoE / Llama-like: embeddings,
    attention with optional q/k norms, dense or MoE MLPs, norms, an LM head unless tied), or from
    `model.tiny`; None when there is no config yet, or one without the decoder's shape."""
    if model.hf_path is None:
        t = model.tiny
        c = dict(hidden_size=t.hidden, num_hidden_layers=t.num_layers, num_attention_heads=t.heads,
                 num_key_value_heads=t.kv_heads, head_dim=t.head_dim, intermediate_size=t.ffn,
                 vocab_size=t.vocab_size, tie_word_embeddings=getattr(t, "tie", False))
        if t.moe:
            c.update(num_experts=t.num_experts, moe_intermediate_size=t.moe_ffn)
    else:
        path = Path(model.hf_path) / "config.json"
        if not path.is_file():
            return None
        c = json.loads(path.read_text())
    if any(k not in c for k in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")):
        return None  # not a decoder config this knows how to count
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv, hd = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd + 2 * h  # q, k, v, o, q/k norms, 2 norms
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    dense = 3 * h * c.get("intermediate_size", 0)
    moe = h * experts + experts * 3 * h * (c.get("moe_intermediate_size") or 0) if experts else dense
    sparse_step = c.get("decoder_sparse_step", 1) or 1
    mlp_only = set(c.get("mlp_only_layers") or [])
    n_moe = sum(1 for i in range(layers) if experts and i not in mlp_only and (i + 1) % sparse_step == 0)
    total = layers * attention + n_moe * moe + (layers - n_moe) * dense + h + vocab * h
    return total + (0 if c.get("tie_word_embeddings", False) else vocab * h)

