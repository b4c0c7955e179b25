"""Drive a transport from the learner: a collective over every learner rank.

Every rank iterates the export (its all-gathers / broadcasts need all model-parallel ranks); only
global rank 0 hands the full tensors to the transport, mapped by `served` (the weights as the
servers take them: FP8 rollouts quantize or round them, weights/fp8.py). The export gathers
`bucket_bytes` of HF tensors at a time (models/weight_export.py; its default is the transports'
default bucket, so the transport's first bucket is ready after one export bucket and the pipeline
of gathers and sends, weights/sync_distributed.py, fills at once). It decides the collectives, so
every rank must pass the same value: never derive it from the transport, which only rank 0 has.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_rl.weights.fp8 import ServedWeights


def push_weights(learner, transport, weight_version: str | None = None, served: ServedWeights | None = None,
                 bucket_bytes: int | None = None):
    """Export the learner's weights (HF names) and send them; returns the transport's stats on
    rank 0, None elsewhere. `bucket_bytes`: the export's bucket (the same on every rank)."""
    served = served or ServedWeights()
    if hasattr(transport, "push_learner"):
        return transport.push_learner(learner, weight_version, served)
    with _serial_host_copies(learner):
        named = _export(learner, bucket_bytes)
        if not dist.is_initialized() or dist.get_rank() == 0:
            return transport.push(served.apply(named), weight_version)
        for _ in named:
            pass
    return None


@contextlib.contextmanager
def _serial_host_copies(learner):
    """A push from host memory with one intra-op thread. Its copies (each bucket into its flat
    buffer, the HF conversions) are memory-bound, and they run while the transport's sender thread
    broadcasts the previous bucket and the servers receive it. A parallel copy ends only when every
    thread of torch's OpenMP pool has run, and the pool's threads spin when they finish, so on
    shared cores each bucket's copy took the cores the sender and the servers needed
    (docs/benchmarks.md, weight sync). On CUDA the copies are the device's and nothing changes.

    The count is restored after the push, failed or not. ATen reads it once per thread, at the
    thread's first parallel op: a thread whose first parallel op falls within a push keeps one
    intra-op thread (the calling thread and every thread that ran one before are unaffected)."""
    device = getattr(getattr(learner, "ctx", None), "device", None)
    on_host = device.type == "cpu" if device is not None else not torch.cuda.is_available()
    threads = torch.get_num_threads()
    if not on_host or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _export(learner, bucket_bytes: int | None):
    """The learner's (HF name, tensor) stream, gathered in buckets of `bucket_bytes` where the
    learner is a Megatron one (a bridge and its chunks)."""
    if bucket_bytes is None or not hasattr(learner, "bridge") or not hasattr(learner, "model"):
        return learner.export_hf_weights()
    from megatron_rl.models.bridge import export_hf_weights

    return export_hf_weights(learner.bridge, learner.model, bucket_bytes)
