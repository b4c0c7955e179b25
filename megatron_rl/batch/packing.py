"""Packed micro-batches: a micro-batch's sequences laid end to end, with no padding between them.

A token-budgeted micro-batch of b sequences is [b, S] with S its longest sequence: every shorter
sequence carries S − len of padding through every layer (`learner.max_tokens_per_micro_batch`
cuts by length to keep that small, not to zero). Packed, the model sees one row of
T = Σ len tokens (rounded up to `multiple`, the tensor-parallel split of sequence parallelism),
in megatron-core's THD layout: `PackedSeqParams` with the sequences' cumulative lengths, so that
attention stays causal within each sequence (models/torch_spec.py `SDPAttention`: torch's varlen
flash attention on CUDA), rotary positions restart at 0 in each one (the position ids do too),
and everything per token (norms, MLPs, experts, the LM head) runs on real tokens only.

The planner cuts packed micro-batches by tokens, not padded slots (`micro.plan_micro_batches(...,
packed=True)`: Σ lengths within `learner.max_tokens_per_micro_batch`, first-fit longest first),
so a budget holds more sequences and a step runs fewer micro-batches. A micro-batch is still
materialised as its [b, S] rows (host, then device) and packed on the device: transient, at most
b × S of the per-token fields (routes, top-K) beside the activations.

Only the model's input and the per-token inputs of the loss are packed. What the loss computes
per token (log π, entropy, divergences; `vocab_parallel`) is unpacked back to [b, S] before
anything that works per sequence (aggregation, GSPO's sequence ratio, ASPO's ranking), so the
algorithms see the layout they always did: `unpack` is an `index_copy` into zeros, differentiable,
and padded positions hold 0 (the loss mask excludes them in both layouts).

The trailing round-up is a segment of its own (cu_seqlens ends ..., n, T), so its rows attend only
among themselves. Everything here is built on the host from lengths the batch already holds, and
moved with the micro-batch: no host synchronisation in the step.

Shapes: b sequences, S the micro-batch's (padded) length, n = Σ len real tokens, T ≥ n packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass(frozen=True)
class Packing:
    """How one micro-batch's [b, S] rows map to its packed [1, T] row."""

    index: torch.Tensor  # [n] int64: position of packed token j in the flattened [b·S]
    b: int
    S: int
    T: int
    params: PackedSeqParams  # THD, cu_seqlens over the sequences and the trailing round-up

    @property
    def n(self) -> int:
        return self.index.numel()

    def pack(self, x: torch.Tensor, fill: float | int | None = None) -> torch.Tensor:
        """[b, S, ...] -> [1, T, ...]: the real tokens in order, then the round-up's rows: `fill`,
        or by default copies of the first token's row (valid ids, top-K rows of distinct ids,
        finite values, whatever the field; nothing reads their results)."""
        rows = x.reshape(self.b * self.S, *x.shape[2:]).index_select(0, self.index)
        if self.T > self.n:
            tail = (rows[:1].expand(self.T - self.n, *rows.shape[1:]) if fill is None
                    else rows.new_full((self.T - self.n, *rows.shape[1:]), fill))
            rows = torch.cat([rows, tail])
        return rows.unsqueeze(0)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] -> [b, S, ...], zeros where [b, S] has padding (differentiable)."""
        y = y[0, : self.n]
        out = y.new_zeros(self.b * self.S, *y.shape[1:]).index_copy(0, self.index, y)
        return out.view(self.b, self.S, *y.shape[1:])

    def record_stream(self, stream) -> None:  # as a tensor of the micro-batch (learner.Prefetched)
        for t in (self.index, self.params.cu_seqlens_q):
            t.record_stream(stream)

    def to(self, device) -> "Packing":
        p = self.params
        cu = p.cu_seqlens_q.to(device)  # one tensor for q and kv: attention sees they are the same
        return Packing(self.index.to(device), self.b, self.S, self.T, PackedSeqParams(  # without a sync
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
            max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_kv))


def packing(lens: torch.Tensor, S: int, multiple: int = 1) -> Packing:
    """The packing of b sequences of lengths `lens` ([b], on the host) held as [b, S] rows: T is
    Σ lens rounded up to `multiple`."""
    lens = lens.to("cpu", torch.int64)
    if lens.numel() == 0 or int(lens.min()) < 1 or int(lens.max()) > S:
        raise ValueError(f"packing: sequence lengths {lens.tolist()} must lie in [1, {S}]")
    b, n = lens.numel(), int(lens.sum())
    T = -(-n // multiple) * multiple
    keep = torch.arange(S, device="cpu")[None, :] < lens[:, None]
    index = keep.reshape(-1).nonzero().squeeze(1)
    bounds = [0, *torch.cumsum(lens, 0).tolist()] + ([T] if T > n else [])
    cu = torch.tensor(bounds, dtype=torch.int32, device="cpu")
    longest = int((cu[1:] - cu[:-1]).max())
    return Packing(index, b, S, T, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                  max_seqlen_q=longest, max_seqlen_kv=longest))


def packed_positions(p: Packing, device) -> torch.Tensor:
    """[1, T] position ids: 0, 1, ... within each segment (from the host's cu_seqlens: before `to`)."""
    cu = p.params.cu_seqlens_q.to("cpu", torch.int64)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return (torch.arange(p.T, device="cpu") - starts).unsqueeze(0).to(device)


def per_token(mb: dict, key: str, fill: float | int | None = None) -> torch.Tensor:
    """`mb[key]` ([b, S, ...]) laid out as the model's output is: packed [1, T, ...] when the
    micro-batch is (`mb["packing"]`), else as it is; None where the micro-batch has no such field
    (as `mb.get`, which the loss closures used before packing)."""
    x, pk = mb.get(key), mb.get("packing")
    return x if pk is None or x is None else pk.pack(x, fill)


def unpacked(mb: dict, x: torch.Tensor | None) -> torch.Tensor | None:
    """A per-token output computed on `per_token` inputs, back in the micro-batch's [b, S, ...]."""
    pk = mb.get("packing")
    return x if pk is None or x is None else pk.unpack(x)
