"""Drive a transport from the learner: a collective over every learner rank.

Every rank iterates mbridge's export (its all-gathers / broadcasts need all model-parallel
ranks); only global rank 0 hands the full tensors to the transport, mapped by `served` (the
weights as the servers take them: FP8 rollouts quantize or round them, weights/fp8.py).
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_rl.weights.fp8 import ServedWeights


def push_weights(learner, transport, weight_version: str | None = None, served: ServedWeights | None = None):
    """Export the learner's weights (HF names) and send them; returns the transport's stats on
    rank 0, None elsewhere."""
    served = served or ServedWeights()
    if hasattr(transport, "push_learner"):
        return transport.push_learner(learner, weight_version, served)
    named = learner.export_hf_weights()
    if not dist.is_initialized() or dist.get_rank() == 0:
        return transport.push(served.apply(named), weight_version)
    for _ in named:
        pass
    return None
