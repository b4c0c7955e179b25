"""The learner's weights as HF tensors, bucket by bucket, with a fixed number of collectives per bucket.

mbridge 0.15.1's `Bridge.export_weights` walks the parameters one at a time and, for each one, runs
two object all-gathers and one object broadcast over the pipeline group (its name and shape), a
broadcast over that group, and an all-gather over the tensor-, expert- or expert-tensor-parallel
group (one more per expert at EP x ETP). At Qwen3-30B-A3B (48 layers x 128 experts x 2 expert
matrices: 12.6 k parameter tensors) that is ~63 k collectives (~100 k NCCL calls) per push, each
a launch and, for the object ones, a pickle and a host synchronisation.

Here, with the same values and the same order as mbridge's:

1. **Plan**, without moving a weight: each rank lists its chunks' parameters in mbridge's order
   with the group each one is gathered over (its `kind`: none, tp, etp, ep, ep+etp), and runs
   mbridge's own merge and HF conversion on meta tensors to learn the HF names, shapes and dtypes
   each becomes. A pipeline stage cuts its list into buckets of about `bucket_bytes` of HF bytes;
   one `all_gather_object` over the pipeline group tells every stage the others' bucket layouts.
2. **Per bucket**, on the stage that holds it: for each kind, the local shards' bytes are packed
   into one flat buffer (each shard at a 16-byte aligned offset) and gathered with one collective
   (ep+etp: over EP, then the result over expert-TP). Each parameter's shards are views of the
   gathered buffers, merged and converted by mbridge's `_weight_merge_across_tp` and
   `_weight_to_hf_format`, so the values are mbridge's bit for bit. With PP > 1 the stage then
   broadcasts the bucket's HF tensors to the other stages as one flat buffer.

So a bucket costs at most 4 collectives (dense TP; the experts' EP, expert-TP or both; the
pipeline broadcast), whatever the number of parameters in it. The plan is cached on the bridge
while the same tensors make up the model.

Every rank yields every (HF name, tensor), as mbridge's export does. One difference: at EP = 1 with
expert-TP = 1 and TP > 1 mbridge all-gathers each expert over the TP group and keeps TP rank 0's
replica; here each rank keeps its own replica (the same values: the experts' gradients are reduced
over a group that holds every replica, models/bridge.py `build_model_chunks`), and the driver is TP
rank 0.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20  # HF bytes gathered per bucket (the transports' default bucket as well)
_ALIGN = 16  # every packed shard starts at a multiple of this, so a byte slice views as any dtype


@dataclass
class _Entry:
    """One Megatron parameter of this rank: its global (TE-style) name, the local tensor, the group
    it is gathered over, and the HF (name, shape, dtype) it becomes."""

    name: str
    param: torch.Tensor
    kind: str
    hf: list[tuple[str, tuple[int, ...], torch.dtype]]

    @property
    def hf_bytes(self) -> int:
        return sum(_nbytes(shape, dtype) for _, shape, dtype in self.hf)


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _kind(mpu, name: str, param: torch.Tensor) -> str:
    """The group(s) a parameter is gathered over, as mbridge's export decides it."""
    if ".mlp.experts.linear_fc" in name:
        if mpu.ep_size > 1:
            return "ep+etp" if mpu.etp_size > 1 else "ep"
        # EP = 1: mbridge gathers experts over the TP group, which equals the expert-TP group when
        # expert-TP = TP; with expert-TP = 1 the copies are replicas (see the module docstring).
        return "etp" if mpu.etp_size > 1 else "none"
    if getattr(param, "tensor_model_parallel", False) and mpu.tp_size > 1:
        return "tp"
    return "none"


def _grid_size(mpu, kind: str) -> tuple[int, int]:
    """(EP copies, TP-like shards) a kind's gather yields."""
    return {"none": (1, 1), "tp": (1, mpu.tp_size), "etp": (1, mpu.etp_size), "ep": (mpu.ep_size, 1),
            "ep+etp": (mpu.ep_size, mpu.etp_size)}[kind]


def _to_hf(bridge, entry: _Entry, shards) -> list[tuple[str, torch.Tensor]]:
    """mbridge's merge and HF conversion of one parameter; `shards[e][t]`: the copy of EP rank e,
    (expert-)TP rank t. Works on meta tensors (the plan) as on real ones."""
    if entry.kind in ("ep", "ep+etp"):
        prefix, local_id = entry.name.split(".weight")
        per_rank = bridge.config.num_moe_experts // bridge.mpu.ep_size
        out = []
        for e, row in enumerate(shards):
            name = f"{prefix}.weight{per_rank * e + int(local_id)}"
            merged = bridge._weight_merge_across_tp(name, row, entry.param)
            out.extend(zip(*bridge._weight_to_hf_format(name, merged)))
        return out
    (row,) = shards
    # A parameter nobody shards is converted as it is (mbridge's merge of one copy returns it).
    merged = row[0] if entry.kind == "none" else bridge._weight_merge_across_tp(entry.name, row, entry.param)
    return list(zip(*bridge._weight_to_hf_format(entry.name, merged)))


def _local_params(models) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """mbridge's order: each chunk's named parameters, then its `expert_bias` buffers (in the state
    dict but not parameters; the buffers themselves, so that identity says a cached plan holds)."""
    out = []
    for model in models:
        out.extend((model, name, p) for name, p in model.named_parameters())
        out.extend((model, name, b) for name, b in model.named_buffers() if "expert_bias" in name)
    return out


def plan(bridge, models, bucket_bytes: int = BUCKET_BYTES) -> list[list[_Entry]]:
    """This rank's parameters as buckets of entries (no communication). Cached on the bridge while
    the same tensors make up the model (a push at 30B would otherwise redo ~13 k meta conversions)."""
    params = _local_params(models)
    key = (bucket_bytes, tuple(id(t) for *_, t in params))
    cached = getattr(bridge, "_export_plan", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    buckets = _plan(bridge, models, params, bucket_bytes)
    bridge._export_plan = (key, buckets)
    return buckets


def _plan(bridge, models, params, bucket_bytes: int) -> list[list[_Entry]]:
    mpu = bridge.mpu
    maps = {id(m): bridge._weight_name_mapping_mcore_local_to_global(m, consider_ep=False) for m in models}
    buckets, current, size = [], [], 0
    for model, local_name, param in params:
        name = maps[id(model)][local_name]
        kind = _kind(mpu, name, param)
        n_ep, n_tp = _grid_size(mpu, kind)
        meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
        entry = _Entry(name, param, kind, [])
        entry.hf = [(n, tuple(t.shape), t.dtype) for n, t in _to_hf(bridge, entry, [[meta] * n_tp] * n_ep)]
        if current and size + entry.hf_bytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.hf_bytes
    if current:
        buckets.append(current)
    return buckets


def _pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Tensors' bytes in one flat uint8 buffer, each at an aligned offset; (buffer, offsets)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += _aligned(t.numel() * t.element_size())
    flat = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        flat[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, offsets


def _unpack(flat: torch.Tensor, off: int, shape, dtype: torch.dtype) -> torch.Tensor:
    return flat[off:off + _nbytes(shape, dtype)].view(dtype).view(shape)


def _all_gather(flat: torch.Tensor, group, size: int) -> torch.Tensor:
    """One all-gather of a flat buffer into one output buffer, the ranks' copies back to back."""
    out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat, group=group)
    return out


def gather_bucket(bridge, entries: list[_Entry]) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one bucket of this stage: one gather per kind present (two for ep+etp)."""
    mpu = bridge.mpu
    shards: dict[int, list[list[torch.Tensor]]] = {}
    by_kind: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(entries):
        by_kind[e.kind].append(i)
    for kind, idx in by_kind.items():
        if kind == "none":
            for i in idx:
                shards[i] = [[entries[i].param]]
            continue
        flat, offsets = _pack([entries[i].param for i in idx])
        if kind == "tp":
            grid = [list(_all_gather(flat, mpu.tp_group, mpu.tp_size).chunk(mpu.tp_size))]
        elif kind == "etp":
            grid = [list(_all_gather(flat, mpu.etp_group, mpu.etp_size).chunk(mpu.etp_size))]
        elif kind == "ep":
            grid = [[b] for b in _all_gather(flat, mpu.ep_group, mpu.ep_size).chunk(mpu.ep_size)]
        else:  # ep+etp: every EP rank's buffer, then that of every expert-TP rank
            by_ep = _all_gather(flat, mpu.ep_group, mpu.ep_size)
            by_tp = _all_gather(by_ep, mpu.etp_group, mpu.etp_size).chunk(mpu.etp_size)
            grid = [[t.chunk(mpu.ep_size)[e] for t in by_tp] for e in range(mpu.ep_size)]
        for i, off in zip(idx, offsets):
            p = entries[i].param
            shards[i] = [[_unpack(buf, off, p.shape, p.dtype) for buf in row] for row in grid]
    out = []
    for i, e in enumerate(entries):
        converted = _to_hf(bridge, e, shards[i])
        # The other pipeline stages unpack this bucket by the plan's meta conversion.
        assert [(n, tuple(t.shape), t.dtype) for n, t in converted] == e.hf, e.name
        out.extend(converted)
    return out


def export_buckets(bridge, models, bucket_bytes: int = BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every rank of the model-parallel group must iterate this (collective). Yields each bucket's
    [(HF name, full tensor)], in mbridge's order; tensors are fresh (never a reused buffer) but may
    be views of a parameter (a weight no rank shards)."""
    from mbridge.core.util import unwrap_model

    models = [unwrap_model(m) for m in models]
    mpu = bridge.mpu
    mine = plan(bridge, models, bucket_bytes)
    if mpu.pp_size == 1:
        for entries in mine:
            yield gather_bucket(bridge, entries)
        return
    # Every stage learns the others' bucket layouts once; then each bucket is gathered by the
    # stage that holds it and broadcast to the others as one flat buffer.
    layouts = [None] * mpu.pp_size
    dist.all_gather_object(layouts, [[(n, s, d) for e in b for n, s, d in e.hf] for b in mine],
                           group=mpu.pp_group)
    device = next((e.param.device for b in mine for e in b), torch.device("cpu"))
    for stage, buckets in enumerate(layouts):
        src = dist.get_global_rank(mpu.pp_group, stage)
        for b, layout in enumerate(buckets):
            if stage == mpu.pp_rank:
                out = gather_bucket(bridge, mine[b])
                flat, _ = _pack([t for _, t in out])
                dist.broadcast(flat, src=src, group=mpu.pp_group)
            else:
                offsets, total = [], 0
                for _, shape, dtype in layout:
                    offsets.append(total)
                    total += _aligned(_nbytes(shape, dtype))
                flat = torch.empty(total, dtype=torch.uint8, device=device)
                dist.broadcast(flat, src=src, group=mpu.pp_group)
                out = [(n, _unpack(flat, off, s, d)) for (n, s, d), off in zip(layout, offsets)]
            yield out
