"""Size-bounded buckets of named tensors, and their flat byte layout for one-shot transfer.

The flat layout is SGLang's `flattened_bucket` format: tensors' bytes back to back in name
order, described by (names, dtypes, shapes). Each bucket holds one dtype, so every tensor starts
at a byte offset aligned to its element size (the receiver checks this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch


@dataclass
class Bucket:
    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def dtypes(self) -> list[str]:
        return [str(t.dtype).removeprefix("torch.") for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]

    def flatten(self) -> torch.Tensor:
        """All tensors' bytes back to back (uint8), in name order."""
        return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in self.tensors])


def bucketize(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int, copy: bool = True) -> Iterator[Bucket]:
    """Group a stream of (name, tensor) into buckets of at most `max_bytes` (a tensor larger than
    that gets a bucket of its own) and of a single dtype; order is preserved within a dtype.
    `copy=False` keeps the tensors as given, for a caller that copies each bucket (`flatten`) as
    soon as it gets it, from an export that never reuses a buffer (models/weight_export.py)."""
    open_buckets: dict[torch.dtype, Bucket] = {}
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        b = open_buckets.get(tensor.dtype)
        if b is not None and b.nbytes + size > max_bytes:
            yield open_buckets.pop(tensor.dtype)
            b = None
        if b is None:
            b = open_buckets[tensor.dtype] = Bucket([], [])
        b.names.append(name)
        # An export may hand out views of buffers it reuses; keep our own copy until sent.
        b.tensors.append(tensor.detach().clone() if copy else tensor.detach())
    yield from open_buckets.values()
