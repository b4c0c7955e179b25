"""mbridge's value-model output layer (`make_value_model`: one row, not vocab-parallel) through the
patched weight loader, at TP2 over real gloo processes.

Reference: the safetensors files themselves. A causal-LM checkpoint's lm_head [V, h] must not be
loaded into the one-row head (it keeps its init, as upstream mbridge does), while every other
weight loads; a checkpoint whose lm_head is already [1, h] (a saved value model) loads that row
on every TP rank.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint


def value_model_worker(rank, world_size, hf_path):
    from mbridge.utils.post_creation_callbacks import make_value_model

    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.models.bridge import load_hf_weights, make_bridge

    cfg = JobConfig()
    cfg.parallel = ParallelConfig(tp=2)
    ctx = init_distributed(cfg.parallel)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(cfg.model.seed)
    bridge = make_bridge(hf_path, cfg.model, ctx)
    model = bridge._model_provider([make_value_model])(pre_process=True, post_process=True)
    init = model.output_layer.weight.detach().clone()
    load_hf_weights(bridge, [model], hf_path)
    return {"init": init, "head": model.output_layer.weight.detach().clone(),
            "norm": model.decoder.final_layernorm.weight.detach().clone()}


@pytest.mark.slow
def test_value_head_loads_only_a_value_head(tmp_path):
    lm = make_tiny_checkpoint(tmp_path / "lm", num_layers=1)
    (tmp_path / "value").mkdir()
    for f in lm.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / "value" / f.name).write_bytes(f.read_bytes())
    files = sorted(lm.glob("*.safetensors"))
    weights = {k: v for f in files for k, v in load_file(f).items()}
    hidden = weights["model.norm.weight"].shape[0]
    weights["lm_head.weight"] = torch.randn(1, hidden, generator=torch.Generator().manual_seed(3))
    save_file(weights, tmp_path / "value" / "model.safetensors", metadata={"format": "pt"})
    assert len(files) == 1 and files[0].name == "model.safetensors"

    ref_norm = weights["model.norm.weight"]
    for r in run_distributed(value_model_worker, 2, str(lm)):
        assert r["head"].shape == (1, hidden)
        assert torch.equal(r["head"], r["init"])  # the LM head [V, h] was not forced into it
        assert torch.equal(r["norm"], ref_norm)
    for r in run_distributed(value_model_worker, 2, str(tmp_path / "value")):
        assert torch.equal(r["head"], weights["lm_head.weight"])  # every TP rank, the same row
