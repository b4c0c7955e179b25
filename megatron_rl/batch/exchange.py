"""Balancing a step's sequences across data-parallel ranks (`rebalance`).

Every producer generated whole prompt groups; before training, sequences move point-to-point
(`batch_isend_irecv`) so that each mini-batch's tokens are balanced across the data-parallel ranks.
Only the moved sequences' bytes travel; nothing is pickled and no rank holds the global batch.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_rl.batch.rollout_batch import RolloutBatch, _bytes  # noqa: F401
from megatron_rl.distributed.collectives import all_gather_varlen

# ----------------------------------------------------------------------------------------------
# balancing across data-parallel ranks
# ----------------------------------------------------------------------------------------------
def balance_plan(lengths: Sequence[torch.Tensor], mini_batch: Sequence[torch.Tensor], n_mini: int
                 ) -> list[torch.Tensor]:
    """Where each rank's sequences go: [dst rank] per sequence, for every rank.

    Per mini-batch, sequences stay where they are unless moving one from the most loaded rank to
    the least loaded lowers the larger of the two loads (tokens): the largest such sequence that
    best evens the pair moves, until no move helps. Deterministic (every rank computes the same
    plan from the all-gathered lengths) and local: only the surplus moves.
    """
    dp = len(lengths)
    dst = [torch.full_like(lengths[r], r) for r in range(dp)]
    for m in range(n_mini):
        mine = [(mini_batch[r] == m).nonzero().flatten() for r in range(dp)]
        # (rank, index) of every sequence per current holder; loads in tokens
        held: list[list[int]] = [[(r, int(i)) for i in mine[r]] for r in range(dp)]
        load = [sum(int(lengths[r][i]) for _, i in held[r]) for r in range(dp)]
        for _ in range(sum(len(h) for h in held)):
            hi = max(range(dp), key=lambda r: (load[r], -r))
            lo = min(range(dp), key=lambda r: (load[r], r))
            gap = load[hi] - load[lo]
            if gap <= 0:
                break
            best, best_after = None, load[hi]
            for j, (r, i) in enumerate(held[hi]):
                L = int(lengths[r][i])
                after = max(load[hi] - L, load[lo] + L)
                if after < best_after:
                    best, best_after = j, after
            if best is None:
                break
            r, i = held[hi].pop(best)
            L = int(lengths[r][i])
            held[lo].append((r, i))
            load[hi] -= L
            load[lo] += L
            dst[r][i] = lo
    return dst


def rebalance(batch: RolloutBatch, group, n_mini: int, device=None) -> tuple[RolloutBatch, dict]:
    """Collective over the data-parallel `group`: exchange sequences point-to-point so that every
    mini-batch's tokens are balanced across the ranks (`balance_plan`); returns this rank's new
    batch (its kept sequences, then the received ones, ordered by mini-batch) and transfer stats.
    Only lengths are all-gathered; sequences travel as one uint8 buffer per (sender, receiver)."""
    device = device or torch.device("cpu")
    dp, me = dist.get_world_size(group), dist.get_rank(group)
    meta = torch.stack([batch.seq["seq_len"], batch.seq["mini_batch"]]).reshape(-1)
    everyone = [m.reshape(2, -1) for m in all_gather_varlen(meta, group, device)]
    plan = balance_plan([e[0] for e in everyone], [e[1] for e in everyone], n_mini)
    schema = batch.schema()
    ops, sends, recvs = [], [], {}
    for peer in range(dp):
        if peer == me:
            continue
        out_idx = (plan[me] == peer).nonzero().flatten()
        in_idx = (plan[peer] == me).nonzero().flatten()
        if out_idx.numel():
            buf, counts = batch.select(out_idx).pack()
            header = torch.tensor([buf.numel()], dtype=torch.int64)
            sends.append((peer, header, counts, buf))
        if in_idx.numel():
            recvs[peer] = in_idx
    peer_rank = lambda p: dist.get_global_rank(group, p)  # noqa: E731
    # Sizes first (one int per pair), then row counts and bytes.
    headers_in = {p: torch.zeros(1, dtype=torch.int64, device=device) for p in recvs}
    ops = [dist.P2POp(dist.isend, h.to(device), peer_rank(p), group) for p, h, _, _ in sends]
    ops += [dist.P2POp(dist.irecv, h, peer_rank(p), group) for p, h in headers_in.items()]
    _run(ops)
    n_tok = sum(kind == "tok" for kind, *_ in schema)
    bufs_in = {p: (torch.empty(n_tok, recvs[p].numel(), dtype=torch.int64, device=device),
                   torch.empty(int(headers_in[p]), dtype=torch.uint8, device=device)) for p in recvs}
    ops = []
    for p, _, counts, buf in sends:
        ops += [dist.P2POp(dist.isend, counts.to(device), peer_rank(p), group),
                dist.P2POp(dist.isend, buf.to(device), peer_rank(p), group)]
    for p, (c, b) in bufs_in.items():
        ops += [dist.P2POp(dist.irecv, c, peer_rank(p), group), dist.P2POp(dist.irecv, b, peer_rank(p), group)]
    _run(ops)
    parts = [batch.select((plan[me] == me).nonzero().flatten())]
    for p in sorted(recvs):
        c, b = bufs_in[p]
        parts.append(RolloutBatch.unpack(b.cpu(), c.cpu(), schema, recvs[p].numel(), batch.pad_id))
    new = RolloutBatch.cat(parts)
    new = new.select(torch.argsort(new.seq["mini_batch"], stable=True))
    stats = {"recv_bytes": sum(int(h) for h in headers_in.values()),
             "sent_bytes": sum(int(h) for _, h, _, _ in sends),
             "moved_sequences": sum(int(v.numel()) for v in recvs.values())}
    return new, stats


def _run(ops: list) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


# ----------------------------------------------------------------------------------------------
