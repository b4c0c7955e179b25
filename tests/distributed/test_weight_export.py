"""The bucketed export (models/weight_export.py) against mbridge's per-parameter one, over gloo.

Every layout the learner runs on CPU with a weight that is gathered differently: TP2 (dense fp32
and bf16, MoE with replicated experts), PP2, PP2xVPP2, EP2, TP2xEP2, TP2xETP2, and at world 4
EP2xETP2 and PP2xEP2. On every rank the bucketed export yields the same (HF name, tensor) pairs in
the same order as upstream's `export_weights_per_parameter`, bit for bit, with one bucket per stage
and with buckets of 64 KiB (its plan cached between exports); and it runs at most 4 collectives per
bucket (counted by wrapping torch.distributed's functions), while upstream's runs several per
parameter.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "broadcast", "broadcast_object_list", "all_reduce", "scatter", "gather", "send", "recv")
SMALL_BUCKET = 64 << 10


@contextlib.contextmanager
def counted():
    """Count calls of torch.distributed's collectives made through the module (nested calls that
    torch makes inside one of them are not counted: one call = one collective asked for)."""
    import torch.distributed as dist

    calls = Counter()
    saved = {}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        setattr(dist, name, wrapper)
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def export_worker(rank, world_size, paths, layouts):
    import torch.distributed as dist

    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.models.bridge import build_model_chunks, load_hf_weights, make_bridge
    from megatron_rl.models.weight_export import export_buckets
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    out = {}
    for name, (model, parallel) in layouts.items():
        cfg = JobConfig()
        cfg.model.hf_path = paths[model]
        cfg.model.dtype = "bfloat16" if name.endswith("bf16") else "float32"
        cfg.parallel = ParallelConfig(**parallel)
        ctx = init_distributed(cfg.parallel)
        model_parallel_cuda_manual_seed(cfg.model.seed)
        bridge = make_bridge(paths[model], cfg.model, ctx)
        chunks = build_model_chunks(bridge, ctx)
        load_hf_weights(bridge, chunks, paths[model])
        n_params = sum(1 for c in chunks for _ in c.named_parameters())
        with counted() as upstream_calls:
            ref = [(n, t.clone()) for n, t in bridge.export_weights_per_parameter(chunks)]
        result = {"n_params": n_params, "upstream": sum(upstream_calls.values())}
        for label, bucket_bytes in (("one", 1 << 40), ("small", SMALL_BUCKET)):
            with counted() as calls:
                buckets = [[(n, t.clone()) for n, t in b] for b in export_buckets(bridge, chunks, bucket_bytes)]
            got = [pair for b in buckets for pair in b]
            assert [n for n, _ in got] == [n for n, _ in ref], f"{name}/{label}: names or order differ"
            for (n, t), (_, r) in zip(got, ref):
                assert t.dtype == r.dtype and torch.equal(t, r), f"{name}/{label}: {n} differs"
            result[label] = {"buckets": len(buckets), "calls": dict(calls)}
        # A second export of the same tensors reuses the plan; the patched Bridge.export_weights
        # is the bucketed export.
        cached = bridge._export_plan
        list(export_buckets(bridge, chunks, SMALL_BUCKET))
        assert bridge._export_plan is cached
        assert [n for n, _ in bridge.export_weights(chunks)] == [n for n, _ in ref]
        dist.barrier()
        out[name] = result
    return out


DENSE = {"tp2": ("dense", {"tp": 2}), "tp2_bf16": ("dense", {"tp": 2}), "pp2": ("dense", {"pp": 2}),
         "pp2_vpp2": ("dense", {"pp": 2, "vpp": 2})}
MOE = {"moe_tp2": ("moe", {"tp": 2}), "ep2": ("moe", {"ep": 2}), "tp2_ep2": ("moe", {"tp": 2, "ep": 2}),
       "tp2_etp2": ("moe", {"tp": 2, "etp": 2})}
WORLD4 = {"ep2_etp2": ("moe", {"tp": 2, "ep": 2, "etp": 2}), "pp2_ep2": ("moe", {"pp": 2, "ep": 2})}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {"dense": str(make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), num_layers=4)),
            "moe": str(make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), moe=True, num_layers=2))}


def _check(results, layouts):
    for rank_out in results:
        for name in layouts:
            r = rank_out[name]
            # Upstream: several collectives per parameter; here at most 4 per bucket + the plan's one.
            assert r["upstream"] >= 4 * r["n_params"], (name, r)
            for label in ("one", "small"):
                calls = sum(r[label]["calls"].values())
                assert calls <= 1 + 4 * r[label]["buckets"], (name, label, r)
            assert r["small"]["buckets"] > r["one"]["buckets"], (name, r)
            assert sum(r["one"]["calls"].values()) <= 12, (name, r)  # one bucket per stage


@pytest.mark.slow
def test_bucketed_export_is_upstreams_at_world_2(paths):
    layouts = {**DENSE, **MOE}
    _check(run_distributed(export_worker, 2, paths, layouts), layouts)


@pytest.mark.slow
def test_bucketed_export_is_upstreams_at_world_4(paths):
    _check(run_distributed(export_worker, 4, paths, WORLD4), WORLD4)
