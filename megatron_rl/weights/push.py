"""Drive a transport from the learner: a collective over every learner rank.

Every rank iterates mbridge's export (its all-gathers / broadcasts need all model-parallel
ranks); only global rank 0 hands the full tensors to the transport.
"""

from __future__ import annotations

import torch.distributed as dist


def push_weights(learner, transport, weight_version: str | None = None):
    """Export the learner's weights (HF names) and send them; returns the transport's stats on
    rank 0, None elsewhere."""
    if hasattr(transport, "push_learner"):
        return transport.push_learner(learner, weight_version)
    named = learner.export_hf_weights()
    if not dist.is_initialized() or dist.get_rank() == 0:
        return transport.push(named, weight_version)
    for _ in named:
        pass
    return None
