"""Weight sync through a HF checkpoint on shared storage (the fallback transport).

The learner writes the checkpoint (a collective: every model-parallel rank takes part, rank 0
writes), then each server reloads from it with `/update_weights_from_disk`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch.distributed as dist

from megatron_rl.weights.endpoint import ServerEndpoint


class DiskWeightSync:
    def __init__(self, servers: Sequence[ServerEndpoint], directory: str | Path, timeout_s: float = 600.0):
        self.servers, self.directory, self.timeout_s = list(servers), Path(directory), timeout_s

    def push_learner(self, learner, weight_version: str | None = None) -> dict:
        """Collective over the learner's ranks; global rank 0 asks the servers to reload."""
        from megatron_rl.models.bridge import save_hf_checkpoint

        start = time.perf_counter()
        save_hf_checkpoint(learner.bridge, learner.model, self.directory, tokenizer_src=learner.hf_path)
        nbytes = sum(p.stat().st_size for p in self.directory.glob("*.safetensors"))
        if not dist.is_initialized() or dist.get_rank() == 0:
            for s in self.servers:
                s.post("/update_weights_from_disk", {"model_path": str(self.directory),
                                                     "weight_version": weight_version}, self.timeout_s)
        return {"bytes": nbytes, "seconds": time.perf_counter() - start, "buckets": 1}
