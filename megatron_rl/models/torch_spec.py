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
  exporting and checkpointing are the local spec's; but their storage is one [E, out, in] tensor
  per projection (each parameter a view of row e, re-homed whenever the module is moved or cast),
  so the grouped GEMM reads the stack in place: no copy per step. One grouped GEMM per projection
  (`torch._grouped_mm`, offsets = cumulative tokens per expert, on the device) on CUDA devices of
  compute capability 9.0+ in bf16 with 16-byte-aligned rows; an exact loop of one matmul per
  expert elsewhere (CPU, fp32, older GPUs). Where something rebinds a parameter's storage (the
  distributed optimizer's parameter buffer) the stack is a copy again, made in the forward and
  once more in the backward (never kept in between).
- MoE layer -> `TorchMoELayer`: megatron-core's `MoELayer` (router, R3 replay, aux losses,
  recompute, shared experts as they are) whose token dispatcher, where no token leaves the rank
  (expert-parallel size 1, expert-tensor-parallel size 1), is `SortedTokenDispatcher`: the
  permutation is computed on the device from the router's map, with static sizes (T·k rows,
  dropless top-k), so a layer's forward and backward make no host synchronisation (megatron-core's
  unfused dispatcher makes several per layer: `masked_select`, the token counts copied to the
  host for `torch.split`, an event wait). Permute = one gather of token rows (the k copies of a
  token are k rows), un-permute = one gather and a sum over each token's k rows (in expert order,
  as megatron-core's scatter-add adds them; deterministic, no atomics), each the other's adjoint.
  With EP > 1 or ETP > 1 megatron-core's all-to-all dispatcher stays: a variable-size all-to-all
  needs its split sizes on the host, one synchronisation per layer that no dispatcher avoids
  without padding to capacity.

Not supported (an error at build time, not a silent difference): context parallelism, sliding
window attention, softmax offsets ("off-by-one"/"learnable"), attention bias, FP8/FP4 experts,
expert biases; with `SortedTokenDispatcher`, token dropping (capacity factor), padding to
capacity or for quantization, and overlapping shared experts with the dispatch.

Shapes: T tokens of a micro-batch on this rank, k = router top-k, J = T·k routed rows, E local
experts, H hidden size, F expert FFN size.
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
from megatron.core.transformer.moe.moe_layer import MoELayer
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
        # The range names this time in a profile (tests/gpu/gpu_profile.py); it costs no sync.
        with rng, torch.profiler.record_function("attention"):
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
        # (`is` first: torch.equal on CUDA tensors waits for the device, once per layer otherwise)
        if (_varlen_attn is not None and q_TND.is_cuda and q_TND.dtype in (torch.bfloat16, torch.float16)
                and dropout_p == 0.0 and unpadded and (cu_q is cu_k or torch.equal(cu_q, cu_k))):
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


def grouped_linear(x_TK: torch.Tensor, weights: Sequence[torch.Tensor], tokens_per_expert,
                   offsets: Optional[torch.Tensor] = None, *, grouped: bool,
                   stacked: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ weights[e]ᵀ: x [T, K] with rows contiguous per
    expert (counts `tokens_per_expert`, summing to T), weights[e] [N, K] (a Linear's [out, in]);
    -> [T, N]. `grouped`: one `torch._grouped_mm` call over the weights as [E, N, K] (`offsets` =
    int32 cumulative counts on x's device; made from the counts if not given); else one matmul per
    expert on the weights themselves (the counts are then needed on the host).

    `stacked`: the weights' own storage as [E, N, K] (`_stacked_view`), read in place. Without it
    the weights are stacked, a copy; autograd would keep it for the input's gradient until the
    backward, one copy of every layer's expert weights per micro-batch in flight. It keeps a
    recipe instead (the weights, which do not change before the optimizer step) and stacks them
    again in the backward."""
    if not grouped:
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        outs = [x_e @ w.t() for x_e, w in zip(torch.split(x_TK, counts), weights)]
        return torch.cat(outs) if outs else x_TK.new_zeros(0, weights[0].shape[0])
    if offsets is None:
        offsets = torch.as_tensor(tokens_per_expert, device=x_TK.device).cumsum(0).to(torch.int32)
    if stacked is not None:
        return torch._grouped_mm(x_TK, stacked.transpose(-2, -1), offs=offsets)
    w_ENK = torch.stack(list(weights))
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


# The expert weights' gradients go into megatron-core DDP's fp32 `main_grad`s from the grouped
# GEMM's backward, one kernel per projection (`_accumulate_main_grads`), instead of DDP's hook adding
# each expert's gradient in a kernel of its own. False: the hooks add (the GPU suite's "before").
FUSED_EXPERT_GRAD_ACCUMULATION = True


class _MainGradRows(NamedTuple):
    """Where DDP keeps a projection's expert `main_grad`s: one flat fp32 span of its buffer and each
    expert's offset in it (host list and device tensor)."""
    flat: torch.Tensor
    offsets: list
    offsets_dev: torch.Tensor
    key: tuple


def _main_grad_rows(weights: Sequence[torch.Tensor]) -> Optional[_MainGradRows]:
    """The weights' `main_grad`s as offsets into one flat fp32 span, when every weight has one
    (megatron-core's DDP: `main_grad` and `grad_added_to_main_grad`), contiguous, all in one
    storage; else None. Any order and any gaps (DDP lays parameters out in reverse; the
    distributed optimizer pads)."""
    grads = [getattr(w, "main_grad", None) for w in weights]
    if not grads or any(g is None or not hasattr(w, "grad_added_to_main_grad") for g, w in zip(grads, weights)):
        return None
    g0 = grads[0]
    storage = g0.untyped_storage().data_ptr()
    if any(g.dtype != torch.float32 or g.numel() != g0.numel() or not g.is_contiguous()
           or g.untyped_storage().data_ptr() != storage for g in grads):
        return None
    lo = min(g.storage_offset() for g in grads)
    hi = max(g.storage_offset() for g in grads) + g0.numel()
    flat = g0.as_strided((hi - lo,), (1,), lo)
    offsets = [g.storage_offset() - lo for g in grads]
    return _MainGradRows(flat, offsets, torch.tensor(offsets, dtype=torch.int64, device=g0.device),
                         (grads[0].data_ptr(), grads[-1].data_ptr()))


def _accumulate_main_grads(grad_ENK: torch.Tensor, weights: Sequence[torch.Tensor], rows: _MainGradRows) -> None:
    """main_grad of weights[e] += grad_ENK[e] for every e, and the weights marked
    `grad_added_to_main_grad` (DDP's hook then skips its own add, as for megatron-core's fused
    weight-gradient accumulation). On CUDA one Triton kernel (triton_accumulate.py: bf16 read,
    fp32 read-modify-write, vectorised); elsewhere the same offsets through one `index_add_`."""
    g = grad_ENK.contiguous()
    if g.is_cuda:
        from megatron_rl.models.triton_accumulate import accumulate_rows

        accumulate_rows(rows.flat, rows.offsets_dev, g)
    else:
        NK = g[0].numel()
        index = (rows.offsets_dev[:, None] + torch.arange(NK, device=g.device)).flatten()
        rows.flat.index_add_(0, index, g.reshape(-1).to(torch.float32))
    for w in weights:
        w.grad_added_to_main_grad = True


class _StackedParams(torch.autograd.Function):
    """The per-expert parameters as the [E, N, K] tensor that holds their storage, without a copy;
    its gradient goes back to each parameter (row e). With `_MainGradRows` (megatron-core's DDP)
    the backward adds the whole gradient to the `main_grad`s itself (`_accumulate_main_grads`) and
    hands each parameter a gradient only so that DDP's hook fires (it marks the bucket ready and
    skips its add)."""

    @staticmethod
    def forward(ctx, holder: tuple, *weights: torch.Tensor) -> torch.Tensor:
        ctx.rows, ctx.weights = holder[1], weights
        return holder[0].view(holder[0].shape)

    @staticmethod
    def backward(ctx, grad_ENK: torch.Tensor):
        grads = grad_ENK.unbind(0)
        if ctx.rows is not None:
            _accumulate_main_grads(grad_ENK, ctx.weights, ctx.rows)
            if not grads[0].is_contiguous():  # autograd would copy each into the parameter's layout
                grads = tuple(torch.empty_like(w) for w in ctx.weights)
        return (None, *grads)


def _stacked_view(buf: Optional[torch.Tensor], weights: Sequence[torch.Tensor],
                  rows: Optional[_MainGradRows] = None) -> Optional[torch.Tensor]:
    """`buf` [E, N, K] as a differentiable stack of `weights` if weights[e] is still row e of
    it (host-side pointer checks only), else None. `rows`: where the backward adds the gradient
    (`_main_grad_rows`), or None (autograd hands each parameter its gradient)."""
    if buf is None or len(weights) != buf.shape[0]:
        return None
    w0 = weights[0]
    if w0.dtype != buf.dtype or w0.device != buf.device or tuple(w0.shape) != tuple(buf.shape[1:]):
        return None
    base, step = buf.data_ptr(), buf.stride(0) * buf.element_size()
    for e, w in enumerate(weights):
        if w.data_ptr() != base + e * step or not w.is_contiguous():
            return None
    return _StackedParams.apply((buf, rows), *weights)


class GroupedExperts(SequentialMLP):
    """The local spec's experts (`SequentialMLP`'s parameters and checkpoint layout) computed
    with one grouped GEMM per projection, their weights stored as one stack per projection
    (see the module docstring)."""

    def __init__(self, num_local_experts, config: TransformerConfig, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        if self.config.fp8 or self.config.fp4:
            raise ValueError("model.spec=torch: FP8/FP4 experts are not supported")
        if self.config.add_bias_linear:
            raise ValueError("model.spec=torch: experts with biases are not supported")
        self._rehome()

    # Plain attributes, not buffers: the state dict and every parameter name stay the local spec's.
    _stacks: dict

    def _weights(self, proj: str) -> list:
        return [getattr(e, proj).weight for e in self.local_experts]

    def _rehome(self) -> None:
        """Move each projection's expert weights into one [E, out, in] tensor (parameter e
        becomes a view of row e; the parameter objects, names and values are unchanged)."""
        stacks = {}
        for proj in ("linear_fc1", "linear_fc2"):
            ws = self._weights(proj)
            if not ws or any(w.dtype != ws[0].dtype or w.shape != ws[0].shape or w.device != ws[0].device
                             for w in ws):
                continue
            with torch.no_grad():
                buf = torch.stack([w.data for w in ws])
            for e, w in enumerate(ws):
                w.data = buf[e]
            stacks[proj] = buf
        object.__setattr__(self, "_stacks", stacks)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .bfloat16() give every parameter new storage: stack them again.
        out = super()._apply(fn, recurse)
        self._rehome()
        return out

    def _rows(self, proj: str, weights: list) -> Optional[_MainGradRows]:
        """`_main_grad_rows(weights)`, found once per DDP buffer (DDP assigns each `main_grad` once;
        the first and last are checked on every call)."""
        if not FUSED_EXPERT_GRAD_ACCUMULATION or getattr(weights[0], "main_grad", None) is None:
            return None
        cache = self.__dict__.setdefault("_main_grad_rows", {})
        rows = cache.get(proj)
        if rows is None or rows.key != (weights[0].main_grad.data_ptr(), weights[-1].main_grad.data_ptr()):
            rows = cache[proj] = _main_grad_rows(weights)
        return rows

    def main_grad_fused(self) -> bool:
        """Whether the backward adds each projection's expert gradients to DDP's `main_grad`s in
        one kernel (`_accumulate_main_grads`), not DDP's hook one per expert."""
        return all(self._rows(p, self._weights(p)) is not None for p in ("linear_fc1", "linear_fc2"))

    def stacked_in_place(self) -> bool:
        """Whether the grouped GEMM reads the expert weights in place (no copy per step)."""
        return all(_stacked_view(self._stacks.get(p), self._weights(p)) is not None
                   for p in ("linear_fc1", "linear_fc2"))

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
        w1, w2 = self._weights("linear_fc1"), self._weights("linear_fc2")  # E x [2F/ETP, H], E x [H, F/ETP]
        grouped = x_TH.shape[0] > 0 and grouped_mm_supported(x_TH, w1[0][None], w2[0][None])
        offsets, s1, s2 = None, None, None
        if grouped:
            # The counts stay where the dispatcher left them: on the device (SortedTokenDispatcher)
            # no host copy is made; megatron-core's all-to-all dispatcher hands them over on the host.
            counts = torch.as_tensor(tokens_per_expert).to(x_TH.device, non_blocking=True)
            offsets = counts.cumsum(0).to(torch.int32)
            s1 = _stacked_view(self._stacks.get("linear_fc1"), w1, self._rows("linear_fc1", w1))
            s2 = _stacked_view(self._stacks.get("linear_fc2"), w2, self._rows("linear_fc2", w2))
        h = grouped_linear(x_TH, w1, tokens_per_expert, offsets, grouped=grouped, stacked=s1)
        with torch.profiler.record_function("moe_expert_act"):
            h = self._activation(h)
            h = (h * probs_T.unsqueeze(-1)).to(h.dtype)
        return grouped_linear(h, w2, tokens_per_expert, offsets, grouped=grouped, stacked=s2), None


# --------------------------------------------------------------------------------------------
# Token dispatch without host synchronisation
# --------------------------------------------------------------------------------------------
class _GatherRows(torch.autograd.Function):
    """y_J = x[src_J] where every x row is read by exactly k rows of y (J = T·k); the gradient is
    a gather of the k rows of each token and their sum (`rows_of_T`: y's rows of token t, [T, k]),
    not an atomic scatter-add."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, src_J: torch.Tensor, rows_Tk: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(src_J, rows_Tk)
        return x_TH.index_select(0, src_J)

    @staticmethod
    def backward(ctx, g_JH: torch.Tensor):
        src_J, rows_Tk = ctx.saved_tensors
        return _sum_rows(g_JH, rows_Tk), None, None


class _SumRows(torch.autograd.Function):
    """out_t = sum over s of y[rows_Tk[t, s]] (s in the order given); the gradient of y_j is
    out's gradient at j's token (`src_J`)."""

    @staticmethod
    def forward(ctx, y_JH: torch.Tensor, rows_Tk: torch.Tensor, src_J: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(src_J, rows_Tk)
        return _sum_rows(y_JH, rows_Tk)

    @staticmethod
    def backward(ctx, g_TH: torch.Tensor):
        src_J, rows_Tk = ctx.saved_tensors
        return g_TH.index_select(0, src_J), None, None


def _sum_rows(y_JH: torch.Tensor, rows_Tk: torch.Tensor) -> torch.Tensor:
    T, k = rows_Tk.shape
    return y_JH.index_select(0, rows_Tk.reshape(-1)).view(T, k, y_JH.shape[-1]).sum(1)


class SortedTokenDispatcher:
    """Token permutation for experts that all live on this rank, with static shapes and no host
    synchronisation (see the module docstring); the interface of megatron-core's
    `MoETokenDispatcher`, used by `MoELayer.forward` unchanged.

    From the router's [T, E] map (k experts per token): each token's experts in ascending order
    ([T, k], a top-k over the map keyed by E − e), a stable sort of the T·k (token, expert) rows by
    expert (rows of one expert stay in token order: megatron-core's order), the counts per expert
    as differences of a `searchsorted` over the sorted ids (no atomics, no `bincount`, whose output
    size would need the host). Rows: J = T·k, row j = token j // k in slot j % k."""

    def __init__(self, config: TransformerConfig, num_local_experts: int):
        self.config = config
        self.num_experts = num_local_experts
        self.topk = config.moe_router_topk
        self.shared_experts = None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map_TE: torch.Tensor,
                            probs_TE: torch.Tensor):
        with torch.profiler.record_function("moe_permute"):
            self.hidden_shape = hidden_states.shape
            x_TH = hidden_states.reshape(-1, self.hidden_shape[-1])
            T, E, k = routing_map_TE.shape[0], self.num_experts, self.topk
            dev = routing_map_TE.device
            key_TE = routing_map_TE.to(torch.int32) * torch.arange(E, 0, -1, device=dev, dtype=torch.int32)
            expert_Tk = E - key_TE.topk(k, dim=1).values  # ascending expert ids of each token
            sorted_J, order_J = torch.sort(expert_Tk.reshape(-1), stable=True)
            # Row j of the permuted tensor holds flat (token, slot) order_J[j]; the inverse says
            # where each token's k rows went.
            rows_Tk = torch.empty_like(order_J).scatter_(
                0, order_J, torch.arange(T * k, device=dev)).view(T, k)
            self.src_J, self.rows_Tk = order_J // k, rows_Tk
            ends = torch.searchsorted(sorted_J, torch.arange(1, E + 1, device=dev, dtype=sorted_J.dtype))
            self.tokens_per_expert = torch.diff(ends, prepend=ends.new_zeros(1))
            probs_J = probs_TE.gather(1, expert_Tk.long()).reshape(-1).index_select(0, order_J)
            x_JH = _GatherRows.apply(x_TH, self.src_J, rows_Tk)
        return x_JH, probs_J

    def token_dispatch(self, x_JH: torch.Tensor, probs_J: torch.Tensor):
        return x_JH, probs_J

    def dispatch_postprocess(self, x_JH: torch.Tensor, probs_J: torch.Tensor):
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return x_JH, tokens_per_expert, probs_J

    def combine_preprocess(self, y_JH: torch.Tensor) -> torch.Tensor:
        return y_JH

    def token_combine(self, y_JH: torch.Tensor) -> torch.Tensor:
        return y_JH

    def combine_postprocess(self, y_JH: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("moe_unpermute"):
            out_TH = _SumRows.apply(y_JH, self.rows_Tk, self.src_J)
            self.src_J = self.rows_Tk = None
        return out_TH.view(self.hidden_shape)


def sorted_dispatch_applies(config: TransformerConfig, ep_size: int, etp_size: int) -> bool:
    """Whether `SortedTokenDispatcher` can stand in for megatron-core's dispatcher: no token leaves
    the rank and the routing is dropless top-k."""
    return (ep_size == 1 and etp_size == 1 and config.moe_expert_capacity_factor is None
            and not config.moe_pad_expert_input_to_capacity
            and not config.moe_router_padding_for_quantization
            and not config.moe_shared_expert_overlap and not config.moe_latent_size)


class TorchMoELayer(MoELayer):
    """megatron-core's `MoELayer` with `SortedTokenDispatcher` where it applies (see the module
    docstring); megatron-core's own dispatcher otherwise. No parameter of its own."""

    def __init__(self, config: TransformerConfig, submodules=None, layer_number=None, pg_collection=None):
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
        d = self.token_dispatcher
        if sorted_dispatch_applies(config, d.ep_size, d.tp_size):
            self.token_dispatcher = SortedTokenDispatcher(config, self.num_local_experts)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        with torch.profiler.record_function("moe_experts"):
            return super().routed_experts_compute(hidden_states, probs)

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        with torch.profiler.record_function("moe_route"):
            return super().route(hidden_states, padding_mask)


# --------------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------------
def get_torch_decoder_block_spec(config: TransformerConfig, vp_stage: Optional[int] = None):
    """megatron-core's local decoder block spec with `SDPAttention` as core attention,
    `TorchMoELayer` as MoE layer and `GroupedExperts` as its experts (every other submodule, and
    so every parameter name, as in the local spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

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
                mlp.module = TorchMoELayer
            swapped[id(spec)] = new
        layers.append(swapped[id(spec)])
    block.layer_specs = layers
    return block

