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

import torch.distributed as dist

from megatron_rl.weights.fp8 import ServedWeights


def push_weights(learner, transport, weight_version: str | None = None, served: ServedWeights | None = None,
                 bucket_bytes: int | None = None):
    """Export the learner's weights (HF names) and send them; returns the transport's stats on
    rank 0, None elsewhere. `bucket_bytes`: the export's bucket (the same on every rank)."""
    served = served or ServedWeights()
    if hasattr(transport, "push_learner"):
        return transport.push_learner(learner, weight_version, served)
    named = _export(learner, bucket_bytes)
    if not dist.is_initialized() or dist.get_rank() == 0:
        return transport.push(served.apply(named), weight_version)
    for _ in named:
        pass
    return None


def _export(learner, bucket_bytes: int | None):
    """The learner's (HF name, tensor) stream, gathered in buckets of `bucket_bytes` where the
    learner is a Megatron one (a bridge and its chunks)."""
    if bucket_bytes is None or not hasattr(learner, "bridge") or not hasattr(learner, "model"):
        return learner.export_hf_weights()
    from megatron_rl.models.bridge import export_hf_weights

    return export_hf_weights(learner.bridge, learner.model, bucket_bytes)
