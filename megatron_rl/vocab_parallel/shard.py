"""Where a logit shard sits in the vocabulary, and the few collectives the module needs.

Megatron shards the (padded) vocabulary contiguously over the tensor-parallel group: rank r of a
group of size TP owns global ids [r * V_local, (r + 1) * V_local). The padded tail
[vocab_size, TP * V_local) belongs to no real token; every function here excludes it, which is the
same as treating those logits as -inf.

`group=None` means a single process holding the full vocabulary: no collective is issued, even if
torch.distributed is initialised (so None never silently means WORLD). Otherwise `group` is any
torch.distributed ProcessGroup (e.g. Megatron's TP group from `dist.new_group`, or a
`ProcessGroupGloo` built directly on a store, which the tests use to run TP ranks as threads); the
collectives are called on the group object itself, so it need not be registered with the default
process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ShardInfo", "shard_info", "vocab_range"]


@dataclass(frozen=True)
class ShardInfo:
    """Geometry of the local shard: global id of its first column, its width, its real columns."""

    rank: int
    world_size: int
    start: int  # global id of local column 0
    local_vocab: int  # V_local: width of the shard, padding included
    n_valid: int  # local columns [0, n_valid) are real tokens; [n_valid, V_local) is padding
    vocab_size: int  # true (unpadded) global vocabulary size

    def local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ids -> (local column clamped into range, mask of ids this shard owns)."""
        local = ids - self.start if self.start else ids
        clamped = local.clamp(0, max(self.local_vocab - 1, 0))
        owned = clamped == local  # in [0, V_local): 3 ops on [T, J] instead of 5
        if self.n_valid < self.local_vocab:  # the shard ends in padding columns
            owned &= local < self.n_valid
        return clamped, owned

    def valid_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids that name a real token (padding and negative ids do not)."""
        return (ids >= 0) & (ids < self.vocab_size)


def _rank_world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return group.rank(), group.size()


def vocab_range(local_vocab: int, group=None) -> tuple[int, int]:
    """[start, end) of the global ids held by this rank's shard of width `local_vocab`."""
    rank, _ = _rank_world(group)
    return rank * local_vocab, (rank + 1) * local_vocab


def shard_info(local_vocab: int, group=None, vocab_size: int | None = None) -> ShardInfo:
    """Geometry of this rank's shard; `vocab_size` is the true vocabulary (None = no padding)."""
    rank, world = _rank_world(group)
    padded = local_vocab * world
    if vocab_size is None:
        vocab_size = padded
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} must be in (0, TP * V_local] = (0, {world} * {local_vocab}]"
        )
    start = rank * local_vocab
    n_valid = min(max(vocab_size - start, 0), local_vocab)
    return ShardInfo(rank, world, start, local_vocab, n_valid, vocab_size)


def all_reduce_(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """In-place all-reduce ('sum' or 'max') over `group`; a no-op for group=None or TP=1."""
    if group is not None and group.size() > 1:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        group.allreduce([t], opts).wait()
    return t


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's copy of `t` (same shape on all ranks), in rank order."""
    if group is None or group.size() == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(group.size())]
    group.allgather([out], [t.contiguous()]).wait()
    return out
