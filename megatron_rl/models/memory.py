"""The learner's GPU memory per rank, by arithmetic: what `dry-run` and `train` print and check
before anything is allocated.

Read from the model's shape (its HF `config.json`, or `model.tiny`) and the parallel layout; every
figure is per rank, on the worst pipeline stage (the first holds the most in-flight micro-batches,
the last the logits; both are counted). Bytes, with b = the model dtype's bytes (2 for bf16):

- **Parameters on this rank.** Dense (attention, norms, router, embedding, output layer): the
  TP-split matrices / TP, the replicated ones (norms, q/k norms, router) whole, layers / PP; the
  vocabulary padded as Megatron pads it (a multiple of make_vocab_size_divisible_by x TP). Expert
  MLPs: E / EP experts of the expert MLP / ETP, layers / PP.
- **Weights** b per parameter. **Gradients** 4 (Megatron's DDP grad buffer is fp32:
  learner/learner.py sets grad_reduce_in_fp32; the buffer is full-size on every rank, the
  distributed optimizer reduce-scatters into it). **Optimizer** Adam's m and v (8) plus the fp32
  main copy of a bf16/fp16 parameter (4), sharded by the distributed optimizer over the
  data-parallel ranks (dense: world / (TP·PP)) and the expert-data-parallel ranks (experts:
  world / (EP·ETP·PP)); not sharded without it.
- **Activations** at T tokens per micro-batch (the token budget, or the longest response when one
  runs alone). Per token and layer on one rank (sequence parallel divides the norm/residual region
  by TP; Megatron requires it for MoE with TP > 1):
    attention  b·(2h/sp + (q+2kv)/TP + 3(q+kv)/TP + q/TP) + 4·heads/TP
               (norm in/out, QKV out, q/k-norm in/out and RoPE out, attention out; fp32 LSE)
    dense MLP  b·(2h/sp + 3·ffn/TP)                (norm in/out, fc1 out, activation out)
    MoE        b·2h/sp + 8·E/sp + K·ETP/sp·g·b·(4h + 3·f/ETP)
               (router logits and probabilities in fp32; per routed copy: permuted, received,
               expert out, combined, fc1 out and activation out; g = 1.25 for the busiest
               expert-parallel rank's share of the routes, which R3 replays without a capacity cap)
  with recompute=full (Megatron's uniform, one layer per checkpoint): each layer keeps its input
  (b·h/sp per token) and one layer at a time is recomputed, its activations and their gradients
  alive together (2 x one layer); without recompute every layer's activations plus one layer's
  gradients. The first pipeline stage keeps PP micro-batches in flight (1F1B; x (1 + (PP-1)/(PP·VPP))
  interleaved), their kept activations, not the working layer, multiplied.
- **Logits** on the vocabulary shard V/TP (padded): the output layer's logits in the model dtype,
  their gradient, and the contiguous copy of that gradient the output layer's backward makes
  (3·T·V/TP·b); the loss accumulates in fp32 one [1024, V/TP] chunk at a time
  (vocab_parallel/logprobs.py), so no fp32 [T, V/TP] copy exists.
- **Margin** 3 GB (the CUDA context, NCCL's communicators and buffers, cuBLAS and Transformer
  Engine workspaces, the step's batch) plus 10 % of activations and logits for the caching
  allocator's fragmentation (micro-batches change shape every step; expandable segments keep it
  small).

A layout above `limit` (learner.memory_limit, 0.95) of the device's memory is refused with what
would bring it under, each option's estimate computed the same way. The estimate is arithmetic,
not a measurement; docs/cluster.md holds the figures per layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Optional

GB = 1e9
TARGET_DEVICE = ("H100 80GB", 80 * GB)  # the GPU recipes' target, where no CUDA device is visible
MARGIN_BYTES = 3 * GB
FRAGMENTATION = 0.10  # of activations and logits
MOE_IMBALANCE = 1.25  # the busiest expert-parallel rank's routed copies over the mean
LOSS_CHUNK = 1024  # rows of the loss's fp32 scratch (vocab_parallel.logprobs.DEFAULT_CHUNK_SIZE)


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """What the estimate needs of a decoder (Qwen3 / Qwen3-MoE / Llama-like)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP width (layers that are not MoE)
    experts: int  # routed experts per MoE layer (0: dense)
    topk: int  # experts per token
    moe_ffn: int  # expert MLP width
    moe_layers: int  # layers with a MoE MLP
    vocab: int  # vocabulary rows before Megatron's padding
    tied: bool  # output layer shares the embedding
    source: str  # where it was read


def model_dims(model) -> Optional[ModelDims]:
    """The shape of `model` (ModelConfig): its hf_path's config.json, or `model.tiny`; None when
    there is no config.json yet or it lacks the decoder's shape (hidden size, layers, heads, vocab)."""
    if model.hf_path is None:
        t = model.tiny
        c = dict(hidden_size=t.hidden, num_hidden_layers=t.num_layers, num_attention_heads=t.heads,
                 num_key_value_heads=t.kv_heads, head_dim=t.head_dim, intermediate_size=t.ffn,
                 vocab_size=t.vocab_size, tie_word_embeddings=False)
        if t.moe:
            c.update(num_experts=t.num_experts, num_experts_per_tok=t.topk, moe_intermediate_size=t.moe_ffn)
        source = "model.tiny"
    else:
        path = Path(model.hf_path) / "config.json"
        if not path.is_file():
            return None
        c, source = json.loads(path.read_text()), str(path)
    if any(k not in c for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")):
        return None
    h, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    step, dense_only = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or [])
    moe_layers = sum(1 for i in range(layers) if experts and i not in dense_only and (i + 1) % step == 0)
    return ModelDims(hidden=h, layers=layers, heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
                     head_dim=int(c.get("head_dim") or h // heads), ffn=int(c.get("intermediate_size") or 0),
                     experts=experts, topk=int(c.get("num_experts_per_tok") or 0) if experts else 0,
                     moe_ffn=int(c.get("moe_intermediate_size") or 0) if experts else 0, moe_layers=moe_layers,
                     vocab=int(c["vocab_size"]), tied=bool(c.get("tie_word_embeddings", False)), source=source)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The learner's parallel layout and what it trains per micro-batch."""

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: Optional[int] = None
    sequence_parallel: bool = False
    tokens: int = 4096  # tokens per micro-batch (padded)
    recompute: bool = False  # full recompute, one layer per checkpoint
    dtype_bytes: int = 2
    distributed_optimizer: bool = True
    vocab_multiple: int = 128  # model.make_vocab_size_divisible_by (x TP)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.ep * self.etp * self.pp)


def padded_vocab(d: ModelDims, lay: Layout) -> int:
    m = lay.vocab_multiple * lay.tp
    return -(-d.vocab // m) * m


def params_per_rank(d: ModelDims, lay: Layout) -> tuple[int, int]:
    """(dense, expert) parameters one rank holds, on the stage holding the most (PP = 1: the only one)."""
    h, tp = d.hidden, lay.tp
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    attention = (h * (q + 2 * kv) + q * h) // tp + 2 * d.head_dim + 2 * h  # qkv, proj; q/k norms, 2 norms
    dense_mlp = 3 * h * d.ffn // tp
    router = h * d.experts
    expert_mlp = (d.experts // lay.ep) * 3 * h * d.moe_ffn // lay.etp
    per_stage = d.layers // lay.pp
    moe = math.ceil(d.moe_layers / lay.pp)  # MoE layers on the stage holding most of them
    dense_layers = min(per_stage, d.layers - d.moe_layers)
    layers = per_stage * attention + moe * router + dense_layers * dense_mlp
    table = padded_vocab(d, lay) * h // tp
    first = table  # the embedding
    last = h + (0 if d.tied and lay.pp == 1 else table)  # final norm + output layer (a copy when tied across stages)
    ends = first + last if lay.pp == 1 else max(first, last)
    return layers + ends, moe * expert_mlp


def layer_activation_bytes(d: ModelDims, lay: Layout, moe: bool) -> float:
    """Saved activations of one layer per token on one rank (the module docstring's terms)."""
    b, h, tp = lay.dtype_bytes, d.hidden, lay.tp
    sp = tp if lay.sequence_parallel else 1
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    attention = b * (2 * h / sp + (q + 2 * kv) / tp + 3 * (q + kv) / tp + q / tp) + 4 * d.heads / tp
    if not moe:
        return attention + b * (2 * h / sp + 3 * d.ffn / tp)
    copies = d.topk * lay.etp / sp * MOE_IMBALANCE
    return attention + b * 2 * h / sp + 8 * d.experts / sp + copies * b * (4 * h + 3 * d.moe_ffn / lay.etp)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """One learner rank's peak, in bytes, and the device it is checked against."""

    dims: ModelDims
    layout: Layout
    dense_params: int
    expert_params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    margin: float
    device_bytes: float
    device_name: str

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.margin

    @property
    def fraction(self) -> float:
        return self.total / self.device_bytes

    def line(self) -> str:
        lay = self.layout
        parts = [f"weights {self.weights / GB:.1f}", f"grads {self.grads / GB:.1f}",
                 f"optimizer {self.optimizer / GB:.1f}", f"activations {self.activations / GB:.1f}",
                 f"logits {self.logits / GB:.1f}", f"margin {self.margin / GB:.1f}"]
        return (f"learner memory per GPU: {self.total / GB:.1f} GB of {self.device_bytes / GB:.1f} "
                f"({self.device_name}), {100 * self.fraction:.0f} % -- " + ", ".join(parts)
                + f" GB; {self.dense_params / 1e9:.2f}B dense + {self.expert_params / 1e9:.2f}B expert parameters "
                f"per rank (TP {lay.tp}, PP {lay.pp}, EP {lay.ep}, ETP {lay.etp}; DP {lay.dp}, expert-DP {lay.edp}), "
                f"{lay.tokens} tokens per micro-batch, recompute {'full' if lay.recompute else 'none'}")


def estimate(d: ModelDims, lay: Layout, device_bytes: float = TARGET_DEVICE[1],
             device_name: str = TARGET_DEVICE[0]) -> MemoryEstimate:
    """The module docstring's arithmetic for `d` at `lay`."""
    dense, expert = params_per_rank(d, lay)
    b = lay.dtype_bytes
    opt_per_param = 8 + (4 if b < 4 else 0)  # Adam m, v (+ the fp32 main copy of a half-precision weight)
    shard_dense, shard_expert = (lay.dp, lay.edp) if lay.distributed_optimizer else (1, 1)
    optimizer = opt_per_param * (dense / shard_dense + expert / shard_expert)

    per_stage = d.layers // lay.pp
    moe_layers = math.ceil(d.moe_layers / lay.pp)
    layer = max(layer_activation_bytes(d, lay, moe=moe_layers > 0),
                layer_activation_bytes(d, lay, moe=False) if per_stage > moe_layers else 0.0)
    sp = lay.tp if lay.sequence_parallel else 1
    if lay.recompute:  # kept per micro-batch in flight; one layer recomputed at a time, with its gradients
        kept, working = per_stage * b * d.hidden / sp, 2 * layer
    else:
        kept = moe_layers * layer_activation_bytes(d, lay, moe=True) \
            + (per_stage - moe_layers) * layer_activation_bytes(d, lay, moe=False)
        working = layer
    in_flight = lay.pp * (1 + (lay.pp - 1) / (lay.pp * lay.vpp)) if lay.vpp else lay.pp
    activations = lay.tokens * (kept * in_flight + working)

    v_local = padded_vocab(d, lay) // lay.tp
    logits = 3 * lay.tokens * v_local * b + 4 * min(LOSS_CHUNK, lay.tokens) * v_local * (1 + 1 / 16)
    margin = MARGIN_BYTES + FRAGMENTATION * (activations + logits)
    return MemoryEstimate(d, lay, dense, expert, weights=b * (dense + expert), grads=4 * (dense + expert),
                          optimizer=optimizer, activations=activations, logits=logits, margin=margin,
                          device_bytes=device_bytes, device_name=device_name)


def _fits(d: ModelDims, lay: Layout) -> bool:
    """`lay` divides the model and the world (models/layout.py and Megatron's rules, in brief)."""
    return (lay.world_size % (lay.tp * lay.pp) == 0 and lay.world_size % (lay.ep * lay.etp * lay.pp) == 0
            and d.heads % lay.tp == 0 and d.kv_heads % lay.tp == 0 and d.layers % lay.pp == 0
            and (not d.experts or d.experts % lay.ep == 0))


def alternatives(est: MemoryEstimate, limit: float, gpus_per_node: int = 8, min_tokens: int = 0) -> list[str]:
    """What would bring `est` under `limit`, each with its own estimate: recompute, the distributed
    optimizer, more learner nodes, larger EP / PP / TP, a smaller token budget (not below `min_tokens`,
    the longest sequence, which runs alone whatever the budget)."""
    d, lay = est.dims, est.layout
    tries = []
    if not lay.recompute:
        tries.append(("model.recompute=full", dataclasses.replace(lay, recompute=True)))
    if not lay.distributed_optimizer:
        tries.append(("optim.use_distributed_optimizer=true", dataclasses.replace(lay, distributed_optimizer=True)))
    for extra in (1, 2, 4):
        more = dataclasses.replace(lay, world_size=lay.world_size + extra * gpus_per_node)
        if _fits(d, more):
            tries.append((f"{more.world_size // gpus_per_node} learner nodes (world size {more.world_size})", more))
    if d.experts:
        tries.append((f"parallel.ep={2 * lay.ep}", dataclasses.replace(lay, ep=2 * lay.ep)))
    tries.append((f"parallel.pp={2 * lay.pp}", dataclasses.replace(lay, pp=2 * lay.pp)))
    tries.append((f"parallel.tp={2 * lay.tp}", dataclasses.replace(lay, tp=2 * lay.tp, sequence_parallel=True)))
    out = []
    for what, alt in tries:
        if not _fits(d, alt):
            continue
        e = estimate(d, alt, est.device_bytes, est.device_name)
        if e.fraction <= limit:
            out.append(f"{what}: {e.total / GB:.1f} GB")
    # the largest budget (a multiple of 1024) that fits: the estimate grows with the tokens
    for budget in range((lay.tokens - 1) // 1024 * 1024, max(min_tokens, 1) - 1, -1024):
        e = estimate(d, dataclasses.replace(lay, tokens=budget), est.device_bytes, est.device_name)
        if budget and e.fraction <= limit:
            out.append(f"learner.max_tokens_per_micro_batch={budget}: {e.total / GB:.1f} GB")
            break
    return out


def check_memory(est: MemoryEstimate, limit: float, gpus_per_node: int = 8, min_tokens: int = 0) -> None:
    """Refuse `est` above `limit` x the device's memory, naming what would bring it under."""
    if limit <= 0 or est.fraction <= limit:
        return
    options = alternatives(est, limit, gpus_per_node, min_tokens)
    raise ValueError(
        f"the learner does not fit its GPUs: {est.line()}; that is above learner.memory_limit={limit:g} "
        f"({limit * est.device_bytes / GB:.1f} GB). "
        + ("Any of these fits: " + "; ".join(options) if options else
           "No single change here brings it under: more learner nodes and a larger EP/TP together")
        + " (learner.memory_limit=0 skips this check; the arithmetic: megatron_rl/models/memory.py)")


def device_memory(hardware: str) -> tuple[float, str]:
    """The learner's GPU memory in bytes and its name: the first visible CUDA device's (read through
    NVML, which creates no CUDA context: every rank runs this before it picks its GPU), else the
    `NNGB` the recipe's `hardware` names (e.g. "4 nodes x 8 H100 80GB"), else an H100 80GB's."""
    import torch

    if torch.cuda.is_available():
        if torch.cuda.is_initialized():
            props = torch.cuda.get_device_properties(0)
            return float(props.total_memory), props.name
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
                handle = (pynvml.nvmlDeviceGetHandleByIndex(int(first)) if first.isdigit()
                          else pynvml.nvmlDeviceGetHandleByUUID(first))
                name = pynvml.nvmlDeviceGetName(handle)
                name = name.decode() if isinstance(name, bytes) else name
                return float(pynvml.nvmlDeviceGetMemoryInfo(handle).total), name
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # no NVML (or an odd CUDA_VISIBLE_DEVICES): the recipe's figure below
            pass
    found = re.search(r"(\d+(?:\.\d+)?)\s*GB", hardware or "")
    if found:
        return float(found.group(1)) * GB, f"{found.group(0).replace(' ', '')}, the recipe's hardware"
    return TARGET_DEVICE[1], f"{TARGET_DEVICE[0]}, the GPU recipes' target"


def job_layout(cfg, world_size: int) -> Layout:
    """The Layout of a run (JobConfig) at `world_size` learner ranks: the micro-batch's tokens are the
    token budget, or the longest response when it is longer (a sequence over the budget runs alone),
    or micro_batch_size responses without a budget (prompts not counted), padded as the learner pads
    them."""
    from megatron_rl.distributed.context import layout_sizes

    s = layout_sizes(cfg.parallel, world_size)
    longest, lc = cfg.rollout.max_new_tokens, cfg.learner
    budget = lc.max_tokens_per_micro_batch
    tokens = max(budget, longest) if budget else lc.micro_batch_size * longest
    multiple = lc.pad_to_multiple_of * (s["tp"] if s["sequence_parallel"] else 1)
    return Layout(world_size=world_size, tp=s["tp"], pp=s["pp"], ep=s["ep"], etp=s["etp"], vpp=s["vpp"],
                  sequence_parallel=s["sequence_parallel"], tokens=-(-tokens // multiple) * multiple,
                  recompute=cfg.model.recompute == "full",
                  dtype_bytes=4 if cfg.model.dtype == "float32" else 2,  # auto: bfloat16 on GPU
                  distributed_optimizer=cfg.optim.use_distributed_optimizer,
                  vocab_multiple=cfg.model.make_vocab_size_divisible_by)


def check_learner_memory(cfg, world_size: int, gpus_per_node: int = 8) -> str:
    """The dry-run's line for a GPU run (JobConfig): one learner rank's estimated peak against its
    device; raises ValueError above learner.memory_limit, naming what to change."""
    d = model_dims(cfg.model)
    if d is None:
        where = f"{cfg.model.hf_path}/config.json" if cfg.model.hf_path else "the model's config"
        return (f"learner memory per GPU: not estimated ({where} lacks hidden_size, num_hidden_layers "
                "or vocab_size)")
    est = estimate(d, job_layout(cfg, world_size), *device_memory(cfg.hardware))
    check_memory(est, cfg.learner.memory_limit, gpus_per_node, min_tokens=cfg.rollout.max_new_tokens)
    rm = cfg.reward_model
    others = [name for name, on in (("critic", cfg.algorithm.advantage == "gae"),
                                    ("reward model", rm.enabled and rm.backend == "megatron"),
                                    ("reference policy", bool(cfg.algorithm.kl_coef))) if on]
    return est.line() + (f" (the policy only; not counted: the {', '.join(others)} on the same GPUs)" if others else "")
