"""`model.spec=torch`: megatron-core's local layers with torch's fused attention and grouped experts.

The spec is megatron-core's local spec (`get_gpt_decoder_block_spec(use_transformer_engine=False)`:
the same norms, column/row-parallel linears, rotary embedding, router and token dispatcher, hence
the same parameter names and the same tensor/sequence/pipeline/expert parallelism) with two
submodules swapped:

- core attention -> `SDPAttention`: softmax(Q Kᵀ · scale + causal mask) V through
  `torch.nn.functional.scaled_dot_product_attention` (flash / cuDNN / memory-efficient kernels on
  CUDA, the math kernel on CPU). Q, K, V arrive as Megatron's [s, b, heads, d] per TP rank; the
  K/V heads are *not* repeated for grouped-query attention (`enable_gqa=True`: query head h reads
  K/V head h // (n_q / n_kv), Megatron's grouping). With no explicit mask and a causal layer the
  kernel applies the causal mask itself; an explicit Megatron mask (True = masked out) is used as
  given, as the local spec's softmax does. Packed sequences (`PackedSeqParams`, THD layout):
  `torch.nn.attention.varlen.varlen_attn` (flash, causal, GQA) on CUDA in bf16/fp16 when the
  packing has no padding between sequences; elsewhere each sequence of the pack runs through
  causal SDPA on its own (exact, a Python loop over sequences). Scale = 1/sqrt(d) unless given.
- MoE experts -> `GroupedExperts`: for expert e's tokens X_e (the dispatcher's permuted rows,
  contiguous per expert) and router probabilities p_e, out_e = (act(X_e W1_eᵀ) · p_e) W2_eᵀ with
  Megatron's gated act (SwiGLU: silu(gate) * up on fc1's two halves), i.e. exactly
  `SequentialMLP` (the local spec's experts). The weights stay the local spec's parameters
  (`local_experts.E.linear_fc1.weight` [2F/ETP, H], `...linear_fc2.weight` [H, F/ETP]), so loading,
  exporting and checkpointing are the local spec's; each projection stacks them to [E, out, in]
  and runs one grouped GEMM (`torch._grouped_mm`, offsets = cumulative tokens per expert) on CUDA
  devices of compute capability 9.0+ in bf16 with 16-byte-aligned rows, and an exact loop of one
  matmul per expert elsewhere (CPU, fp32, older GPUs). The stack copies each layer's expert
  weights once in the forward and once more in the backward (the backward's copy is made there,
  not kept from the forward); its gradient splits back into the per-expert parameters.

Not supported (an error at build time, not a silent difference): context parallelism, sliding
window attention, softmax offsets ("off-by-one"/"learnable"), attention bias, FP8/FP4 experts,
expert biases.
"""

from __future__ import annotations

import copy
import inspect
import math
from contextlib import nullcontext
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------
class SDPAttention(MegatronModule):
    """Core attention through torch's `scaled_dot_product_attention` (see the module docstring).

    Same constructor and forward signature as megatron-core's `DotProductAttention`, so it drops
    into `SelfAttentionSubmodules.core_attention`. Inputs [s, b, n, d] (THD: [t, n, d]); output
    [s, b, n·d] (THD: [t, n·d]).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("model.spec=torch has no context parallelism (context_parallel_size must be 1)")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("model.spec=torch has no sliding-window attention (window_size must be None)")
        if config.softmax_type != "vanilla":
            raise ValueError(f"model.spec=torch supports softmax_type='vanilla' only, not {config.softmax_type!r}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_kv_heads = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        # Megatron's apply_query_key_layer_scaling divides the scores by the layer number and its
        # softmax multiplies them back: the net scale is this one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("model.spec=torch: attention_bias is not supported")
        dropout_p = self.dropout_p if self.training else 0.0
        # Dropout in attention draws from the tensor-parallel RNG like the local spec's.
        rng = (tensor_parallel.get_cuda_rng_tracker().fork()
               if dropout_p > 0 and not self.config.sequence_parallel else nullcontext())
        with rng:
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params, dropout_p)
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            s, b = query.shape[0], query.shape[1]
            # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if attention_mask is None:
                keep, causal = None, mask_type == AttnMaskType.causal
            else:
                keep, causal = ~attention_mask, False  # Megatron: True = masked out; SDPA: True = attend
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p,
                                                 is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            # [b, n, s, d] -> [s, b, n·d]
            return out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)

    def _packed(self, q_TND, k_TND, v_TND, params: PackedSeqParams, dropout_p: float) -> torch.Tensor:
        """THD: causal attention within each packed sequence; [t, n, d] -> [t, n·d]."""
        if params.qkv_format != "thd":
            raise ValueError(f"model.spec=torch: packed sequences in {params.qkv_format!r} format; only 'thd'")
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_kv
        start_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else cu_q
        start_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else cu_k
        unpadded = start_q is cu_q or torch.equal(start_q, cu_q)
        if (_varlen_attn is not None and q_TND.is_cuda and q_TND.dtype in (torch.bfloat16, torch.float16)
                and dropout_p == 0.0 and unpadded and torch.equal(cu_q, cu_k)):
            out = _varlen_attn(q_TND, k_TND, v_TND, cu_q.int(), cu_k.int(), int(params.max_seqlen_q),
                               int(params.max_seqlen_kv), scale=self.softmax_scale,
                               gqa=self.num_heads != self.num_kv_heads)
            return out.reshape(out.shape[0], -1)
        # Exact fallback: each sequence through causal SDPA. Padding rows between sequences stay 0.
        out = q_TND.new_zeros(q_TND.shape)
        lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
        for i, (sq, sk, a, c) in enumerate(zip(lens_q, lens_k, start_q.tolist(), start_k.tolist())):
            if sq == 0:
                continue
            q, k, v = (t.transpose(0, 1)[None] for t in (q_TND[a:a + sq], k_TND[c:c + sk], v_TND[c:c + sk]))
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                               scale=self.softmax_scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            out[a:a + sq] = o[0].transpose(0, 1)
        return out.reshape(out.shape[0], -1)


def _make_varlen_attn():
    """torch's varlen flash attention, causal and GQA, across the torch versions that have it
    (`window_size=(-1, 0)` or the older `is_causal=True`; K/V repeated where `enable_gqa` is
    absent); None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    native_gqa = "enable_gqa" in params

    def run(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, gqa):
        extra = dict(causal, scale=scale)
        if gqa and native_gqa:
            extra["enable_gqa"] = True
        elif gqa:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)

    return run


_varlen_attn = _make_varlen_attn()


# --------------------------------------------------------------------------------------------
# Experts
# --------------------------------------------------------------------------------------------
def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs its grouped kernel here: CUDA compute capability 9.0+,
    bf16, every row 16-byte aligned (torch's checks). Elsewhere it would loop (or refuse)."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(w.dtype == torch.bfloat16 for w in weights) and all(
        d % 8 == 0 for w in (x, *weights) for d in w.shape[1:])


def grouped_linear(x_TK: torch.Tensor, weights: Sequence[torch.Tensor], tokens_per_expert: list[int],
                   offsets: Optional[torch.Tensor] = None, *, grouped: bool) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ weights[e]ᵀ: x [T, K] with rows contiguous per
    expert (counts `tokens_per_expert`, summing to T), weights[e] [N, K] (a Linear's [out, in]);
    -> [T, N]. `grouped`: the weights stacked to [E, N, K] and one `torch._grouped_mm` call
    (`offsets` = int32 cumulative counts on x's device); else one matmul per expert on the
    weights themselves.

    The stack is a copy; autograd would keep it for the input's gradient until the backward,
    one copy of every layer's expert weights per micro-batch in flight. It keeps a recipe
    instead (the weights, which do not change before the optimizer step) and stacks them
    again in the backward."""
    if not grouped:
        outs = [x_e @ w.t() for x_e, w in zip(torch.split(x_TK, tokens_per_expert), weights)]
        return torch.cat(outs) if outs else x_TK.new_zeros(0, weights[0].shape[0])
    w_ENK = torch.stack(list(weights))
    if offsets is None:
        offsets = torch.tensor(tokens_per_expert, device=x_TK.device).cumsum(0).to(torch.int32)
    with torch.autograd.graph.saved_tensors_hooks(*_restack_hooks(w_ENK, weights)):
        return torch._grouped_mm(x_TK, w_ENK.transpose(-2, -1), offs=offsets)


def _restack_hooks(stacked: torch.Tensor, weights: Sequence[torch.Tensor]):
    """saved_tensors_hooks that save views of `stacked` as (weights, view geometry) and rebuild
    them by stacking `weights` again when the backward needs them; other tensors pass."""
    ptr = stacked.untyped_storage().data_ptr()
    weights = tuple(weights)

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == ptr:
            return _Restack(weights, t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(saved):
        if isinstance(saved, _Restack):
            w = torch.stack([p.detach() for p in saved.weights])
            return w.as_strided(saved.size, saved.stride, saved.offset)
        return saved

    return pack, unpack


class _Restack(NamedTuple):
    weights: tuple
    size: torch.Size
    stride: tuple
    offset: int


class GroupedExperts(SequentialMLP):
    """The local spec's experts (`SequentialMLP`'s parameters and checkpoint layout) computed
    with one grouped GEMM per projection (see the module docstring)."""

    def __init__(self, num_local_experts, config: TransformerConfig, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        if self.config.fp8 or self.config.fp4:
            raise ValueError("model.spec=torch: FP8/FP4 experts are not supported")
        if self.config.add_bias_linear:
            raise ValueError("model.spec=torch: experts with biases are not supported")

    def _activation(self, h_TF: torch.Tensor) -> torch.Tensor:
        """MLP.forward's unfused activation (the local spec's experts), gated or not."""
        c = self.config
        if not c.gated_linear_unit:
            return c.activation_func(h_TF)
        x_glu, x_linear = torch.chunk(h_TF, 2, dim=-1)
        if (val := c.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return c.activation_func(x_glu) * (x_linear + c.glu_linear_offset)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x_TH, probs_T = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            x_TH = (probs_T.unsqueeze(-1) * x_TH).to(x_TH.dtype)
            probs_T = torch.ones_like(probs_T)
        # Expert linears do no communication inside (the dispatcher does it), so the local shards'
        # plain products are the local spec's results.
        w1 = [e.linear_fc1.weight for e in self.local_experts]  # E x [2F/ETP, H]
        w2 = [e.linear_fc2.weight for e in self.local_experts]  # E x [H, F/ETP]
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        grouped = x_TH.shape[0] > 0 and grouped_mm_supported(x_TH, w1[0][None], w2[0][None])
        offsets = None
        if grouped:
            offsets = torch.as_tensor(counts, device=x_TH.device).cumsum(0).to(torch.int32)
        h = grouped_linear(x_TH, w1, counts, offsets, grouped=grouped)
        h = self._activation(h)
        h = (h * probs_T.unsqueeze(-1)).to(h.dtype)
        return grouped_linear(h, w2, counts, offsets, grouped=grouped), None


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------
def get_torch_decoder_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None):
    """megatron-core's local decoder block spec with `SDPAttention` as core attention and
    `GroupedExperts` as MoE experts (every other submodule, and so every parameter name, as in
    the local spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    swapped = {}  # the local spec shares one layer spec between layers: swap each once
    layers = []
    for spec in block.layer_specs:
        if id(spec) not in swapped:
            new = copy.deepcopy(spec)
            attn = new.submodules.self_attention.submodules
            if attn.core_attention is not DotProductAttention:
                raise TypeError(f"model.spec=torch expected the local spec's core attention, "
                                f"found {attn.core_attention}")
            attn.core_attention = SDPAttention
            mlp = new.submodules.mlp
            if mlp.module is MoELayer:
                if mlp.submodules.experts.module is not SequentialMLP:
                    raise TypeError("model.spec=torch expected the local spec's SequentialMLP experts "
                                    f"(moe_grouped_gemm off), found {mlp.submodules.experts.module}")
                mlp.submodules.experts.module = GroupedExperts
            swapped[id(spec)] = new
        layers.append(swapped[id(spec)])
    block.layer_specs = layers
    return block

