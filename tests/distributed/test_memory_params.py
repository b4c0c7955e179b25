"""The memory estimate's parameters per rank (megatron_rl/models/memory.py `params_per_rank`) against
real Megatron-Core models built over gloo: each rank's dense and expert parameters (numel) at TP 2
(sequence parallel, a vocabulary Megatron pads), PP 2, EP 2 and TP 2 x EP 2, the estimate being the
rank that holds the most. One process group of 2 for every layout (Megatron's parallel state rebuilt
for each, as in test_learner_layouts.py).
"""

from __future__ import annotations

import pytest

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

LAYOUTS = {  # name: (model, parallel)
    "dense_tp2": ("dense", dict(tp=2)),
    "dense_pp2": ("dense", dict(pp=2)),
    "moe_ep2": ("moe", dict(ep=2)),
    "moe_tp2_ep2": ("moe", dict(tp=2, ep=2)),
}


def count_worker(rank, world_size, paths, layouts):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.config.schema import ModelConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.models.bridge import build_model_chunks, make_bridge

    out = {}
    for name, (which, parallel) in layouts.items():
        ctx = init_distributed(ParallelConfig(**parallel))
        model_parallel_cuda_manual_seed(0)  # the init's RNG states (the CPU layer stands in for CUDA's)
        bridge = make_bridge(paths[which], ModelConfig(hf_path=paths[which], dtype="float32", spec="local"), ctx)
        params = [(n, p) for chunk in build_model_chunks(bridge, ctx) for n, p in chunk.named_parameters()]
        out[name] = (sum(p.numel() for n, p in params if ".mlp.experts." not in n),
                     sum(p.numel() for n, p in params if ".mlp.experts." in n))
    return out


@pytest.mark.slow
def test_params_per_rank_equal_the_built_models(tmp_path):
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.memory import Layout, model_dims, params_per_rank

    # 300 rows: Megatron pads them to 512 at TP 2 (a multiple of 128 x 2), 384 at TP 1
    paths = {"dense": str(make_tiny_checkpoint(tmp_path / "dense", vocab_size=300)),
             "moe": str(make_tiny_checkpoint(tmp_path / "moe", moe=True, vocab_size=300))}
    ranks = run_distributed(count_worker, 2, paths, LAYOUTS)
    for name, (which, parallel) in LAYOUTS.items():
        tp = parallel.get("tp", 1)
        lay = Layout(world_size=2, tp=tp, pp=parallel.get("pp", 1), ep=parallel.get("ep", 1),
                     sequence_parallel=tp > 1)
        built = [r[name] for r in ranks]
        estimated = params_per_rank(model_dims(ModelConfig(hf_path=paths[which])), lay)
        assert estimated == (max(b[0] for b in built), max(b[1] for b in built)), (name, built, estimated)
