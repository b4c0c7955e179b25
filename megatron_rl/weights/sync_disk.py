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
from megatron_rl.weights.fp8 import ServedWeights


class DiskWeightSync:
    def __init__(self, servers: Sequence[ServerEndpoint], directory: str | Path, timeout_s: float = 600.0):
        self.servers, self.directory, self.timeout_s = list(servers), Path(directory), timeout_s

    def push_learner(self, learner, weight_version: str | None = None, served: ServedWeights | None = None) -> dict:
        """Collective over the learner's ranks; global rank 0 asks the servers to reload. With FP8
        rollouts (`served`) rank 0 writes the served tensors itself, one safetensors file per
        `shard_bytes`."""
        from megatron_rl.models.bridge import save_hf_checkpoint

        start = time.perf_counter()
        if served is None or served.quantization == "none":
            save_hf_checkpoint(learner.bridge, learner.model, self.directory, tokenizer_src=learner.hf_path)
        else:
            named = learner.export_hf_weights()
            if not dist.is_initialized() or dist.get_rank() == 0:
                write_safetensors(served.apply(named), self.directory, learner.hf_path)
            else:
                for _ in named:
                    pass
            if dist.is_initialized():
                dist.barrier()
        nbytes = sum(p.stat().st_size for p in self.directory.glob("*.safetensors"))
        if not dist.is_initialized() or dist.get_rank() == 0:
            for s in self.servers:
                s.post("/update_weights_from_disk", {"model_path": str(self.directory),
                                                     "weight_version": weight_version}, self.timeout_s)
        return {"bytes": nbytes, "seconds": time.perf_counter() - start, "buckets": 1}


def write_safetensors(named, directory: str | Path, config_src: str | Path | None = None,
                      shard_bytes: int = 4 << 30) -> None:
    """(name, tensor) pairs -> `directory` as HF safetensors shards with their index (and config.json
    etc. copied from `config_src`); the old shards are removed first."""
    import json
    import shutil

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    shards, current, size = [], {}, 0
    for name, t in named:
        if current and size + t.numel() * t.element_size() > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.detach().cpu().contiguous()
        size += t.numel() * t.element_size()
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config_src is not None:
        for p in Path(config_src).iterdir():
            if p.is_file() and p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
                shutil.copy(p, directory / p.name)
