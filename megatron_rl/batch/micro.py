"""Micro-batch planning: which sequences of a rank's batch form each micro-batch, and their layout.

`plan_micro_batches` cuts a batch under `learner.max_tokens_per_micro_batch` (token budget, least
padding) or `learner.micro_batch_size` (sequences); the learner materialises one micro-batch at a
time (`RolloutBatch.micro_batch`), each trimmed to its own longest sequence.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from megatron_rl.batch.rollout_batch import RolloutBatch
from megatron_rl.rollout.records import no_route

# micro-batches
# ----------------------------------------------------------------------------------------------
def padded_len(n: int, multiple: int) -> int:
    return -(-max(n, 1) // multiple) * multiple


def plan_micro_batches(seq_lens: torch.Tensor, *, max_tokens: int = 0, max_sequences: int = 0,
                       multiple: int = 1, n_micro: Optional[int] = None, packed: bool = False) -> list[torch.Tensor]:
    """Cut sequences into micro-batches: lists of indices, each trimmed to its own longest.

    `max_tokens` > 0: sequences sorted by length are cut into runs of neighbours, each within the
    budget (sequences × padded longest ≤ max_tokens; a longer sequence runs alone), choosing the
    cut that minimises padded slots plus a fixed cost per micro-batch (`_least_padding`).
    `packed` (micro-batches run end to end, batch/packing.py: a micro-batch costs its tokens, not
    its longest × its count): the budget bounds the sum of the lengths (rounded up to `multiple`),
    filled first-fit over the sequences longest first (`_fill_tokens`), so fewer micro-batches.
    Otherwise `max_sequences` per micro-batch in the given order. `n_micro` (≥ what the budget needs): split
    further — the largest micro-batches in halves — until there are that many (ranks that must run
    the same number of micro-batches, e.g. expert-parallel peers); empty ones are not made here.
    """
    n = seq_lens.numel()
    if n == 0:
        return []
    if max_tokens > 0:
        out = (_fill_tokens if packed else _least_padding)(seq_lens, max_tokens, multiple)
    else:
        size = max_sequences or n
        out = [list(range(a, min(a + size, n))) for a in range(0, n, size)]
    out = [torch.tensor(mb, dtype=torch.int64) for mb in out]
    return split_micro_batches(out, n_micro) if n_micro is not None else out


def split_micro_batches(plan: list[torch.Tensor], n_micro: int) -> list[torch.Tensor]:
    """Halve the largest micro-batches (by sequences) until there are `n_micro`, or every one holds
    a single sequence."""
    out = list(plan)
    while len(out) < n_micro:
        j = max(range(len(out)), key=lambda k: (out[k].numel(), -k))
        if out[j].numel() < 2:
            break
        half = out[j].numel() // 2
        out[j:j + 1] = [out[j][:half], out[j][half:]]
    return out


def widen_routes(routes: torch.Tensor) -> torch.Tensor:
    """Routes as the router replay reads them: int64, −1 where a position has no route. Compact
    routes (uint8 / int16 with `no_route`) are widened on their own device; int64 ones pass."""
    if routes.dtype == torch.int64:
        return routes
    return routes.long().masked_fill_(routes == no_route(routes.dtype), -1)


def route_fill(dtype: torch.dtype) -> int:
    """The padding value of routes of `dtype`: −1 for int64, `no_route` for compact ones."""
    return -1 if dtype == torch.int64 else no_route(dtype)


def empty_micro_batch(batch: RolloutBatch, S: int) -> dict[str, torch.Tensor]:
    """One padding sequence of S positions with no loss (a rank's filler micro-batch)."""
    out = {}
    for name, (dtype, trail) in batch.spec.items():
        wide = torch.long if name in ("input_ids", "topk_ids") else dtype
        out[name] = torch.full((1, S, *trail), batch.fill(name, dtype), dtype=wide)
    out["labels"] = torch.full((1, S), batch.pad_id, dtype=torch.long)
    for name, v in batch.seq.items():
        out[name] = torch.zeros(1, dtype=v.dtype)
    return out


MICRO_BATCH_COST = 1 / 16
"""A micro-batch's fixed cost (kernel launches, pipeline hand-offs), as a fraction of the token
budget: two runs of sequences share a micro-batch only when that saves more padding than this."""


def _least_padding(seq_lens: torch.Tensor, max_tokens: int, multiple: int) -> list[list[int]]:
    """Dynamic programme over the sequences sorted longest first: best[j] = the least cost of
    cutting the first j into micro-batches, a micro-batch [i, j) costing its padded slots
    (padded length of sequence i × (j − i)) plus MICRO_BATCH_COST × max_tokens. O(n²) in numpy
    (n = this rank's sequences of one mini-batch)."""
    import numpy as np

    order = torch.argsort(seq_lens, descending=True, stable=True).numpy()
    lens = seq_lens.numpy()[order].astype(np.int64)
    padded = -(-np.maximum(lens, 1) // multiple) * multiple
    n = len(lens)
    fixed = MICRO_BATCH_COST * max_tokens
    best = np.zeros(n + 1)
    start = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        i = np.arange(j)
        slots = padded[i] * (j - i)
        cost = best[:j] + slots + fixed
        cost[(slots > max_tokens) & (j - i > 1)] = np.inf
        k = int(np.argmin(cost))
        best[j], start[j] = cost[k], k
    cuts, j = [], n
    while j > 0:
        cuts.append((int(start[j]), j))
        j = int(start[j])
    return [order[a:b].tolist() for a, b in reversed(cuts)]


def _fill_tokens(seq_lens: torch.Tensor, max_tokens: int, multiple: int) -> list[list[int]]:
    """First-fit decreasing: each sequence, longest first, joins the first micro-batch whose
    tokens (rounded up to `multiple`) stay within `max_tokens` with it, else starts one (a longer
    sequence runs alone). At most one micro-batch is under half full, so their number is about
    Σ lengths / max_tokens."""
    order = torch.argsort(seq_lens, descending=True, stable=True).tolist()
    lens = seq_lens.tolist()
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = max(int(lens[i]), 1)
        for j, u in enumerate(used):
            if -(-(u + n) // multiple) * multiple <= max_tokens:
                bins[j].append(i)
                used[j] += n
                break
        else:
            bins.append([i])
            used.append(n)
    return bins


def padding_waste(seq_lens: torch.Tensor, micro_batches: Iterable[torch.Tensor], multiple: int = 1) -> tuple[int, int]:
    """(padded slots, all slots) over `micro_batches` (each padded to its own longest)."""
    pad = slots = 0
    for mb in micro_batches:
        lens = seq_lens[mb]
        S = padded_len(int(lens.max()), multiple)
        slots += S * mb.numel()
        pad += S * mb.numel() - int(lens.sum())
    return pad, slots
