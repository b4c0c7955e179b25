"""Fused Triton kernels for log pi(ids) and the entropy over a vocabulary shard: one pass forward,
one pass backward.

Shapes: T tokens (leading dims flattened), V_l the local shard width (Megatron layout: the shard's
first global id is rank * V_l; global ids >= vocab_size are padding), J ids asked per token (1 for
a_t; K + 1 for the top-K support {a_t} ∪ topK_mu of `fused.vocab_parallel_policy_stats`), Jg <= J
the ids that receive a gradient.

Maths: the same as `logprobs.py` (x = raw logits, alpha = 1 / tau), reorganised so that each
shard reads its logits once in the forward:
  kernel pass (per row, over tiles of BLOCK_V columns, the shard's own max m_r updated online):
      m_r = max_i x_i                 S_r = sum_i exp(z_i)        W_r = sum_i exp(z_i) z_i
      with z_i = (x_i - m_r) * alpha; when a tile raises the max by d = (m_new - m_old) * alpha,
      S <- S e^-d and W <- (W - d S) e^-d (z shifts by -d), then the tile's terms are added;
      in the same pass x at the row's J ids this shard owns (-inf elsewhere) is gathered.
  torch, [T]-sized (the cross-shard reductions of `logprobs.forward_pass`, same collectives):
      all-reduce MAX of [m_r, x_ids]  -> the global max M and each id's logit (from its owner)
      c_r = (m_r - M) * alpha;  all-reduce SUM of [S_r e^c_r, (W_r + c_r S_r) e^c_r] -> S, W
      lse = M alpha + log S;   log pi(j) = x_j alpha - lse;   H = log S - W / S
  backward kernel (one pass: reads x, writes the gradient; p recomputed from the saved lse):
      d/dx_i = alpha * (-p_i sum_j g_j + sum_j g_j 1[i = j] - g_H p_i (log p_i + H))
Exact across TP: every shard's partials are rescaled to the global max before the sum, as in
the torch path; nothing full-vocabulary is gathered.

Passes over the logits: forward 1 (read), backward 1 (read x, write the gradient). Memory beyond
the gradient: [T, 3 + J] fp32 partials and [T] saved statistics, no [chunk, V_l] buffer at all.
With inplace_logits the backward writes the gradient over the logits' own storage (any float
dtype; the forward leaves them intact), so the gradient needs no memory of its own either.
Accumulation is fp32 (fp64 for fp64 logits); bf16/fp16 gradients are rounded once, at the store.

Triton is imported lazily (only when a kernel is first needed): on a CPU install without triton,
nothing changes. The kernels run on CUDA tensors, or on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, set before the first call), which is how the CPU tests check them.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

from .shard import ShardInfo, all_reduce_, shard_info

__all__ = ["DEFAULT_BLOCK_V", "triton_available", "triton_log_probs_and_entropy"]

DEFAULT_BLOCK_V = 4096  # columns per tile: 16 KiB of fp32 per row in flight, 37 tiles at V=151936
_NUM_WARPS = 8

# Triton's interpreter keeps the current program id in module-global state, so two threads that
# launch at once (the CPU tests run TP ranks as threads) would corrupt each other's grid: under
# the interpreter launches are serialised. Compiled launches are not affected.
_INTERPRET_LOCK = threading.Lock()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    """Whether triton is importable here (without importing it when it is not)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels():
    """Import triton and build the two kernels (once). Raises a clear ImportError without it."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError(
            "kernel='triton' needs the triton package, which is not importable here "
            f"({e}); install triton (CUDA wheels of torch ship it) or use kernel='torch'"
        ) from e

    @triton.jit
    def fwd_kernel(
        x_ptr, stride_x, lid_ptr, part_ptr, gath_ptr,
        n_valid, n_ids, alpha,
        ACC: tl.constexpr, WANT_W: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_J: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        cols = tl.arange(0, BLOCK_V)
        m = tl.full((), float("-inf"), ACC)
        s = tl.zeros((), ACC)
        w = tl.zeros((), ACC)
        for start in range(0, n_valid, BLOCK_V):
            c = start + cols
            inside = c < n_valid
            x = tl.load(x_row + c, mask=inside, other=float("-inf")).to(ACC)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # d >= 0; the first tile has m = -inf and s = w = 0: keep d finite there (no inf * 0).
            d = tl.where(s > 0, (m_new - m) * alpha, 0.0)
            scale = tl.exp(-d)
            # z = 0 on masked columns (not -inf), so that exp(z) z is never 0 * -inf = nan.
            z = tl.where(inside, (x - m_new) * alpha, 0.0)
            e = tl.where(inside, tl.exp(z), 0.0)
            s_old = s
            s = s_old * scale + tl.sum(e, axis=0)
            if WANT_W:
                w = (w - d * s_old) * scale + tl.sum(e * z, axis=0)
            m = m_new
        tl.store(part_ptr + row * 3, m)
        tl.store(part_ptr + row * 3 + 1, s)
        tl.store(part_ptr + row * 3 + 2, w)
        # The row's ids owned by this shard, as local columns (-1: owned elsewhere / no token).
        j = tl.arange(0, BLOCK_J)
        in_j = j < n_ids
        lid = tl.load(lid_ptr + row * n_ids + j, mask=in_j, other=-1)
        g = tl.load(x_row + lid, mask=in_j & (lid >= 0), other=float("-inf")).to(ACC)
        tl.store(gath_ptr + row * n_ids + j, g, mask=in_j)

    @triton.jit
    def bwd_kernel(
        x_ptr, stride_x, out_ptr, stride_out, stat_ptr, lid_ptr, gs_ptr,
        n_valid, n_cols, alpha,
        ACC: tl.constexpr, ENT: tl.constexpr, N_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        o_row = out_ptr + row * stride_out
        # stat: [lse, H, alpha * sum_j g_j, alpha * g_H] of this row
        lse = tl.load(stat_ptr + row * 4)
        ent = tl.load(stat_ptr + row * 4 + 1)
        g_sum = tl.load(stat_ptr + row * 4 + 2)
        g_h = tl.load(stat_ptr + row * 4 + 3)
        cols = tl.arange(0, BLOCK_V)
        for start in range(0, n_cols, BLOCK_V):
            c = start + cols
            inside = c < n_cols
            valid = c < n_valid  # padding columns take no part in the softmax: gradient 0
            x = tl.load(x_row + c, mask=valid, other=0.0).to(ACC)
            logp = x * alpha - lse
            p = tl.exp(logp)
            grad = -p * g_sum
            if ENT:
                grad -= g_h * p * (logp + ent)
            for k in tl.static_range(N_GRAD):
                # scatter of the ids' upstream gradients (duplicates add up, as the chain rule asks)
                lid_k = tl.load(lid_ptr + row * N_GRAD + k)
                gs_k = tl.load(gs_ptr + row * N_GRAD + k)
                grad += tl.where(c == lid_k, gs_k, 0.0)
            grad = tl.where(valid, grad, 0.0)
            tl.store(o_row + c, grad.to(out_ptr.dtype.element_ty), mask=inside)

    return triton, tl, fwd_kernel, bwd_kernel


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_acc(tl, dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _launch(kernel, grid, *args, **meta):
    if _interpreting():
        with _INTERPRET_LOCK:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, num_warps=_NUM_WARPS, **meta)


def _owned_local(info: ShardInfo, ids_TJ: torch.Tensor) -> torch.Tensor:
    """Local column of each id this shard owns (a real token in its range), -1 elsewhere."""
    local, owned = info.local_ids(ids_TJ)
    return torch.where(owned & info.valid_ids(ids_TJ), local, -1).contiguous()


def shard_forward(x2d: torch.Tensor, ids_TJ: torch.Tensor, info: ShardInfo, temperature: float,
                  want_entropy: bool, block_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel pass over one shard: (partials [T, 3] = (m_r, S_r, W_r), x_ids [T, J] gathered
    logits, -inf where this shard does not own the id), in the accumulation dtype."""
    _, tl, fwd_kernel, _ = _kernels()
    T, J = ids_TJ.shape
    acc = _acc(x2d.dtype)
    part = torch.empty(T, 3, dtype=acc, device=x2d.device)
    gath = torch.empty(T, J, dtype=acc, device=x2d.device)
    if T:
        lid = _owned_local(info, ids_TJ)
        _launch(fwd_kernel, (T,), x2d, x2d.stride(0), lid, part, gath, info.n_valid, J,
                1.0 / temperature, ACC=_tl_acc(tl, x2d.dtype), WANT_W=want_entropy,
                BLOCK_V=block_v, BLOCK_J=max(_next_pow2(J), 2))
    return part, gath


def combine_shards(part: torch.Tensor, gath: torch.Tensor, temperature: float, reduce):
    """The cross-shard reductions: `reduce(tensor, op)` all-reduces in place ('max' / 'sum').
    Returns (logp [T, J], lse [T], entropy [T]) (entropy meaningful only if W was accumulated)."""
    alpha = 1.0 / temperature
    mx = torch.cat([part[:, :1], gath], dim=1)
    reduce(mx, "max")  # global max and each id's logit from its owner (-inf: no shard owns it)
    M = mx[:, 0]
    m_r, s_r, w_r = part.unbind(1)
    c = (m_r - M) * alpha
    f = torch.exp(c)
    has = s_r > 0  # a shard of padding only has m_r = -inf, S_r = 0: (W_r + c S_r) would be nan
    sums = torch.stack([s_r * f, torch.where(has, (w_r + c * s_r) * f, 0.0)], dim=1)
    reduce(sums, "sum")
    log_s = torch.log(sums[:, 0])
    lse = M * alpha + log_s
    ent = log_s - sums[:, 1] / sums[:, 0]
    logp = mx[:, 1:] * alpha - lse[:, None]
    return logp, lse, ent


def shard_backward(x2d: torch.Tensor, out: torch.Tensor, info: ShardInfo, ids_TJ: torch.Tensor,
                   g_logp: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                   g_ent: torch.Tensor | None, temperature: float, block_v: int) -> torch.Tensor:
    """The backward kernel pass: writes d(sum g_logp * logp + g_ent * H)/dx into `out`."""
    _, tl, _, bwd_kernel = _kernels()
    T = x2d.shape[0]
    acc = lse.dtype
    alpha = 1.0 / temperature
    valid = info.valid_ids(ids_TJ)
    g = torch.where(valid, g_logp.to(acc), torch.zeros((), dtype=acc, device=lse.device))
    stat = torch.stack([lse, ent, g.sum(-1) * alpha,
                        (g_ent.to(acc) * alpha) if g_ent is not None else torch.zeros_like(lse)], 1)
    lid = _owned_local(info, ids_TJ)
    gs = (g * alpha).contiguous()
    if T:
        _launch(bwd_kernel, (T,), x2d, x2d.stride(0), out, out.stride(0), stat.contiguous(), lid,
                gs, info.n_valid, x2d.shape[1], alpha, ACC=_tl_acc(tl, x2d.dtype),
                ENT=g_ent is not None, N_GRAD=ids_TJ.shape[1], BLOCK_V=block_v)
    return out


class _TritonLogProbsEntropy(torch.autograd.Function):
    """(log pi(ids) [T, J], entropy [T]) from the fused kernels (see module docstring)."""

    @staticmethod
    def forward(ctx, x2d, ids_TJ, info, group, temperature, want_entropy, entropy_grad, inplace,
                grad_columns, block_v):
        part, gath = shard_forward(x2d, ids_TJ, info, temperature, want_entropy, block_v)
        logp, lse, ent = combine_shards(part, gath, temperature,
                                        lambda t, op: all_reduce_(t, op, group))
        ctx.save_for_backward(x2d, ids_TJ, lse, ent)
        ctx.info, ctx.temperature, ctx.inplace, ctx.grad_columns, ctx.block_v = (
            info, temperature, inplace, grad_columns, block_v)
        ctx.entropy_grad = want_entropy and entropy_grad
        ctx.set_materialize_grads(False)
        if not want_entropy:
            ent = lse.new_empty(0)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x2d, ids_TJ, lse, ent = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros(ids_TJ.shape, dtype=lse.dtype, device=x2d.device)
        if ctx.grad_columns is not None:  # the caller promised zero gradients beyond these
            ids_TJ, g_logp = ids_TJ[:, :ctx.grad_columns], g_logp[:, :ctx.grad_columns]
        use_ent = ctx.entropy_grad and g_ent is not None
        if ctx.inplace:
            # Each element is read before it is written, by the same program: the logits' storage
            # becomes the gradient. Bump the version so autograd rejects any other user of them.
            out = x2d
            torch.autograd.graph.increment_version(x2d)
        else:
            out = torch.empty_like(x2d)
        shard_backward(x2d, out, ctx.info, ids_TJ, g_logp, lse, ent, g_ent if use_ent else None,
                       ctx.temperature, ctx.block_v)
        return out, None, None, None, None, None, None, None, None, None


def triton_log_probs_and_entropy(
    logits: torch.Tensor,
    ids: torch.Tensor,
    group=None,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    inplace_logits: bool = False,
    grad_columns: int | None = None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs.vocab_parallel_log_probs_and_entropy` with the fused Triton kernels.

    Same arguments and results (logp shaped like ids, entropy [...] or None; fp32, fp64 for fp64
    logits), except: no chunk_size (the kernels need no [chunk, V_l] buffer); block_v = columns per
    tile (a power of two; default min(4096, V_l rounded up)); inplace_logits = the backward
    writes the gradient over the logits (contiguous logits of any float dtype, entropy gradient
    allowed; the logits are garbage after backward, which may run once).
    """
    _kernels()  # without triton, say so first
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not (logits.is_cuda or _interpreting()):
        raise ValueError("kernel='triton' runs on CUDA tensors (or on CPU under Triton's "
                         f"interpreter, TRITON_INTERPRET=1); got logits on {logits.device}")
    lead = logits.shape[:-1]
    single = ids.dim() == logits.dim() - 1
    if tuple(ids.shape[: len(lead)]) != tuple(lead) or ids.dim() not in (len(lead), len(lead) + 1):
        raise ValueError(f"ids shape {tuple(ids.shape)} does not match logits {tuple(logits.shape)}")
    x2d = logits.reshape(-1, logits.shape[-1])
    if x2d.shape[1] and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    if inplace_logits and (x2d.data_ptr() != logits.data_ptr() or not logits.is_contiguous()):
        raise ValueError("inplace_logits needs contiguous logits")
    ids_TJ = ids.reshape(x2d.shape[0], -1).long().contiguous()
    info = shard_info(x2d.shape[1], group, vocab_size)
    if block_v is None:
        block_v = min(DEFAULT_BLOCK_V, _next_pow2(max(x2d.shape[1], 16)))
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    logp, ent = _TritonLogProbsEntropy.apply(
        x2d, ids_TJ, info, group, float(temperature), with_entropy, entropy_grad, inplace_logits,
        grad_columns, int(block_v),
    )
    logp = logp.reshape(ids.shape) if not single else logp.reshape(lead)
    return logp, (ent.reshape(lead) if with_entropy else None)
