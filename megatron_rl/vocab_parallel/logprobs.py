"""Log-probabilities of given ids and entropy from a vocab-sharded logit tensor, in one pass.

Shapes: T tokens (all leading dims flattened), V the padded global vocabulary, V_l = V / TP the
local shard width, J ids asked per token (1 for the sampled token; K + 1 for the top-K support).

Math (x = raw logits, tau = temperature, alpha = 1 / tau, m = max_i x_i over the whole vocab):
    z_i   = (x_i - m) * alpha                      (<= 0; the global max comes from an all-reduce MAX)
    S     = sum_i exp(z_i)                         (local partial sums, all-reduce SUM)
    lse   = m * alpha + log S                      (log-partition of x / tau)
    log pi(j) = x_j * alpha - lse                  (x_j from the shard owning id j, -inf on the
                                                    others: rides in the MAX all-reduce)
    H     = -sum_i p_i log p_i = log S - W / S,  W = sum_i exp(z_i) z_i
Backward (hand-written, recomputing p from the saved lse instead of storing a [T, V_l] softmax):
    d log pi(j) / d x_i = (1[i = j] - p_i) * alpha
    d H / d x_i         = -p_i (log p_i + H) * alpha

Memory: one accumulation-dtype scratch buffer [chunk, V_l] per call (fp32 for bf16/fp16/fp32
logits, fp64 for fp64), reused across token chunks; with entropy, a second temporary of at most
max(chunk/16 rows, 256k elements). For fp32 logits the backward writes straight into the gradient
tensor, so it needs no scratch at all. With inplace_logits (fp32/fp64 only) the logits' own
storage serves as the buffer and then as the gradient (Megatron's trick): no extra memory and one
exp pass in total.
Padded vocabulary columns (global id >= vocab_size) are excluded (-inf); ids outside
[0, vocab_size) get log-prob -inf and no gradient. Logits are assumed finite.
"""

from __future__ import annotations

import torch

from .shard import ShardInfo, all_reduce_, shard_info

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "temperature_scale",
    "vocab_parallel_log_probs",
    "vocab_parallel_entropy",
    "vocab_parallel_log_probs_and_entropy",
]

DEFAULT_CHUNK_SIZE = 1024
_ENTROPY_SUBBLOCKS = 16  # entropy needs exp(z) and z at once: temporaries of chunk/16 rows,
_MIN_SUBBLOCK_ELEMS = 1 << 18  # but at least 256k elements (1 MiB fp32): small vocabularies
# would otherwise pay 16x the per-op overhead for a temporary nobody would notice


def temperature_scale(logits: torch.Tensor, temperature: float, inplace: bool = False) -> torch.Tensor:
    """logits / temperature (what every probability in ALGORITHMS.md is computed from)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if temperature == 1.0:
        return logits
    return logits.div_(temperature) if inplace else logits / temperature


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64, everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_chunk(chunk_size: int) -> int:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def _row_blocks(n: int, block: int):
    for r0 in range(0, n, block):
        yield r0, min(r0 + block, n)


def _subblock_rows(rows: int, cols: int) -> int:
    return max(1, -(-rows // _ENTROPY_SUBBLOCKS), _MIN_SUBBLOCK_ELEMS // max(cols, 1))


def _sumexp_and_w(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_i exp z_i, sum_i exp(z_i) z_i) per row, keeping z; temporaries of one sub-block
    (`_subblock_rows`)."""
    rows = z.shape[0]
    s = z.new_empty(rows)
    w = z.new_empty(rows)
    for b0, b1 in _row_blocks(rows, _subblock_rows(rows, z.shape[1])):
        e = torch.exp(z[b0:b1])
        s[b0:b1] = e.sum(-1)
        w[b0:b1] = e.mul_(z[b0:b1]).sum(-1)
    return s, w


def forward_pass(
    x2d: torch.Tensor,
    ids_TJ: torch.Tensor,
    info: ShardInfo,
    group,
    temperature: float,
    chunk_size: int,
    want_entropy: bool,
    extra_chunk_fn=None,
    inplace: bool = False,
):
    """One pass over the shard. Returns (logp_TJ, lse_T, entropy_T or None, log S_T), acc dtype.

    `extra_chunk_fn(r0, r1, x_chunk, z_chunk_or_None)` is called per chunk before exp (top-K of
    the current policy uses it); it must not modify its arguments.
    inplace (x2d must have the acc dtype): the valid columns of x2d are overwritten with
    exp(z) = exp(x * alpha - m * alpha) instead of using a scratch buffer.
    """
    T = x2d.shape[0]
    J = ids_TJ.shape[1]
    acc = acc_dtype(x2d.dtype)
    alpha = 1.0 / temperature
    nv = info.n_valid
    logp = torch.empty(T, J, dtype=acc, device=x2d.device)
    lse = torch.empty(T, dtype=acc, device=x2d.device)
    log_sum = torch.empty(T, dtype=acc, device=x2d.device)
    ent = torch.empty(T, dtype=acc, device=x2d.device) if want_entropy else None
    local, owned = info.local_ids(ids_TJ)
    neg_inf = torch.full((), float("-inf"), dtype=acc, device=x2d.device)
    chunk = min(check_chunk(chunk_size), max(T, 1))
    buf = None if inplace or not T else torch.empty(chunk, nv, dtype=acc, device=x2d.device)
    n_stats = 2 if want_entropy else 1
    for r0, r1 in _row_blocks(T, chunk):
        r = r1 - r0
        xc = x2d[r0:r1, :nv]
        # One MAX all-reduce carries the row max and the asked logits: an id's logit is -inf on
        # every shard but its owner's, so the max is the owner's value, and an id no shard owns
        # (negative, padding, out of range) stays -inf: its log-prob is -inf without a mask.
        # The gather comes before the all-reduce: it does not depend on the max.
        mx = torch.empty(r, 1 + J, dtype=acc, device=x2d.device)
        if nv:
            mx[:, 0] = xc.amax(-1)
        else:  # a shard made only of padding
            mx[:, 0] = float("-inf")
        if J:
            g = x2d[r0:r1].gather(1, local[r0:r1])
            torch.where(owned[r0:r1], g.to(acc), neg_inf, out=mx[:, 1:])
        all_reduce_(mx, "max", group)
        m_a = mx[:, 0] * alpha  # scaled with the same alpha as x, so z = 0 exactly at the max
        z = xc if inplace else buf[:r]
        # z = x * alpha - m * alpha in one pass; the add promotes bf16 to the acc dtype per element.
        torch.add(-m_a[:, None], xc, alpha=alpha, out=z)
        if extra_chunk_fn is not None:
            extra_chunk_fn(r0, r1, xc, z)
        sums = torch.empty(r, n_stats, dtype=acc, device=x2d.device)
        if want_entropy:
            sums[:, 0], sums[:, 1] = _sumexp_and_w(z)
            if inplace:
                z.exp_()
        else:
            sums[:, 0] = z.exp_().sum(-1)
        all_reduce_(sums, "sum", group)
        s = sums[:, 0]
        log_s = torch.log(s)
        lse[r0:r1] = m_a + log_s
        log_sum[r0:r1] = log_s
        if J:  # log pi(j) = x_j * alpha - lse
            torch.add(-lse[r0:r1, None], mx[:, 1:], alpha=alpha, out=logp[r0:r1])
        if want_entropy:
            ent[r0:r1] = log_s - sums[:, 1] / s
    return logp, lse, ent, log_sum


class _LogProbsEntropy(torch.autograd.Function):
    """(log pi(ids) [T, J], entropy [T]) with the backward written out (see module docstring)."""

    @staticmethod
    def forward(
        ctx, x2d, ids_TJ, info, group, temperature, chunk_size, want_entropy, entropy_grad, inplace,
        grad_columns,
    ):
        logp, lse, ent, log_sum = forward_pass(
            x2d, ids_TJ, info, group, temperature, chunk_size, want_entropy, inplace=inplace
        )
        # In place, x2d holds exp(z) = S * p, so the backward needs log S rather than lse.
        ctx.save_for_backward(x2d, ids_TJ, log_sum if inplace else lse, ent if want_entropy else lse)
        ctx.info, ctx.temperature, ctx.chunk_size, ctx.inplace, ctx.grad_columns = (
            info, temperature, chunk_size, inplace, grad_columns,
        )
        ctx.entropy_grad = want_entropy and entropy_grad
        ctx.set_materialize_grads(False)  # unused outputs arrive as None, not zero tensors
        if not want_entropy:
            ent = lse.new_empty(0)
        if not (want_entropy and entropy_grad):
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x2d, ids_TJ, lse, ent = ctx.saved_tensors
        info: ShardInfo = ctx.info
        alpha = 1.0 / ctx.temperature
        acc = lse.dtype
        T, nv = x2d.shape[0], info.n_valid
        if g_logp is None:
            g_logp = torch.zeros(ids_TJ.shape, dtype=acc, device=x2d.device)
        if ctx.grad_columns is not None:  # the caller promised zero gradients beyond these
            # (the fused entry point's top-K columns, which gate without a gradient: 1 id scattered)
            ids_TJ, g_logp = ids_TJ[:, :ctx.grad_columns], g_logp[:, :ctx.grad_columns]
        valid = info.valid_ids(ids_TJ)
        g_logp = torch.where(valid, g_logp.to(acc), torch.zeros((), dtype=acc))
        local, owned = info.local_ids(ids_TJ)
        g_scatter = torch.where(owned, g_logp * alpha, torch.zeros((), dtype=acc))
        g_sum = g_logp.sum(-1) * alpha  # sum_j g_j, pre-multiplied by alpha
        use_ent = ctx.entropy_grad and g_ent is not None
        if use_ent:
            g_h = g_ent.to(acc) * alpha
        if ctx.inplace:
            if use_ent:
                raise RuntimeError("inplace_logits=True keeps no log-probs for an entropy gradient")
            # x2d already holds exp(z) = S * p: the gradient -p * sum_j g_j + scatter(g) is built
            # on that storage in one pass, as megatron-core's vocab_parallel_cross_entropy does.
            grad = x2d
            if nv < x2d.shape[1]:
                grad[:, nv:] = 0
            inv_s = torch.exp(-lse)  # saved log S here: 1 / S
            for r0, r1 in _row_blocks(T, min(ctx.chunk_size, max(T, 1))):
                dst = grad[r0:r1, :nv]
                dst.mul_((-g_sum[r0:r1] * inv_s[r0:r1])[:, None])
                if nv and ids_TJ.shape[1]:
                    dst.scatter_add_(1, local[r0:r1].clamp(max=nv - 1), g_scatter[r0:r1])
            return grad, None, None, None, None, None, None, None, None, None
        grad = torch.empty_like(x2d)
        if nv < x2d.shape[1]:
            grad[:, nv:] = 0  # padding takes no part in the softmax
        direct = grad.dtype == acc  # write into the gradient itself: no scratch buffer
        chunk = min(ctx.chunk_size, max(T, 1))
        buf = None if direct or T == 0 else torch.empty(chunk, nv, dtype=acc, device=x2d.device)
        for r0, r1 in _row_blocks(T, chunk):
            r = r1 - r0
            dst = grad[r0:r1, :nv] if direct else buf[:r]
            # dst = log p_i = x_i * alpha - lse
            torch.add(-lse[r0:r1, None], x2d[r0:r1, :nv], alpha=alpha, out=dst)
            if use_ent:
                # dst = -p_i * (sum_j g_j + g_H (log p_i + H)) * alpha, in row sub-blocks
                for b0, b1 in _row_blocks(r, _subblock_rows(r, nv)):
                    d = dst[b0:b1]
                    p = torch.exp(d)
                    rows = slice(r0 + b0, r0 + b1)
                    d.add_(ent[rows, None]).mul_(g_h[rows, None]).add_(g_sum[rows, None])
                    d.mul_(p).neg_()
            else:
                dst.exp_().mul_(-g_sum[r0:r1, None])
            if nv and ids_TJ.shape[1]:
                # scatter_add accumulates duplicate ids, as the chain rule asks.
                dst.scatter_add_(1, local[r0:r1].clamp(max=nv - 1), g_scatter[r0:r1])
            if not direct:
                grad[r0:r1, :nv].copy_(dst)
        return grad, None, None, None, None, None, None, None, None, None


def _flatten(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension")
    return logits.reshape(-1, logits.shape[-1])


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    ids: torch.Tensor,
    group=None,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    inplace_logits: bool = False,
    grad_columns: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(ids) and entropy of softmax(logits / temperature) over the sharded vocabulary.

    logits: local shard [..., V_l] (any float dtype; accumulates in fp32, or fp64 for fp64).
    ids: global token ids, shape [...] (one per token) or [..., J]; outside [0, vocab_size) -> -inf.
    Returns (logp shaped like ids, entropy [...] or None), differentiable w.r.t. logits (the
    entropy only if entropy_grad).
    inplace_logits: for contiguous fp32/fp64 logits that nothing else reads afterwards (the
    usual case for the output layer's logits in a loss), overwrite them with exp(z) during the
    forward and turn that storage into the gradient in the backward, as megatron-core's
    vocab_parallel_cross_entropy does. Saves the scratch buffer and the backward's exp pass;
    the logits are garbage afterwards (their version counter is bumped, so autograd rejects any
    other graph that saved them) and backward may run once. No entropy gradient in this mode.
    grad_columns: only the first grad_columns ids per token receive a gradient (the caller
    promises the others' are zero, e.g. ids kept for divergences that gate without one).
    """
    lead = logits.shape[:-1]
    x2d = _flatten(logits)
    single = ids.dim() == logits.dim() - 1
    if tuple(ids.shape[: len(lead)]) != tuple(lead) or ids.dim() not in (len(lead), len(lead) + 1):
        raise ValueError(f"ids shape {tuple(ids.shape)} does not match logits {tuple(logits.shape)}")
    ids_TJ = ids.reshape(x2d.shape[0], -1).long()
    info = shard_info(x2d.shape[1], group, vocab_size)
    temperature_scale(logits, temperature)  # validates
    if inplace_logits:
        if x2d.dtype != acc_dtype(x2d.dtype) or x2d.data_ptr() != logits.data_ptr():
            raise ValueError("inplace_logits needs contiguous fp32 or fp64 logits "
                             f"(got {logits.dtype}, contiguous={logits.is_contiguous()})")
        if with_entropy and entropy_grad:
            raise ValueError("inplace_logits keeps no log-probs for an entropy gradient; "
                             "pass entropy_grad=False or inplace_logits=False")
    logp, ent = _LogProbsEntropy.apply(
        x2d, ids_TJ, info, group, float(temperature), check_chunk(chunk_size), with_entropy,
        entropy_grad, inplace_logits, grad_columns,
    )
    logp = logp.reshape(ids.shape) if not single else logp.reshape(lead)
    return logp, (ent.reshape(lead) if with_entropy else None)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    group=None,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    inplace_logits: bool = False,
) -> torch.Tensor:
    """log softmax(logits / temperature)[ids] over the sharded vocabulary (differentiable).

    See `vocab_parallel_log_probs_and_entropy` for shapes and `inplace_logits`."""
    logp, _ = vocab_parallel_log_probs_and_entropy(
        logits, ids, group, temperature=temperature, vocab_size=vocab_size,
        chunk_size=chunk_size, with_entropy=False, inplace_logits=inplace_logits,
    )
    return logp


def vocab_parallel_entropy(
    logits: torch.Tensor,
    group=None,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Entropy [...] of softmax(logits / temperature) over the sharded vocabulary (differentiable)."""
    ids = torch.empty(*logits.shape[:-1], 0, dtype=torch.long, device=logits.device)
    _, ent = vocab_parallel_log_probs_and_entropy(
        logits, ids, group, temperature=temperature, vocab_size=vocab_size,
        chunk_size=chunk_size, with_entropy=True,
    )
    return ent
