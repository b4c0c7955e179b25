"""The bucketed export (models/weight_export.py) against mbridge's per-parameter one, over gloo; in
the same world-2 process group, the pipelined push and the memory estimate's parameters per rank.

Export: every layout the learner runs on CPU with a weight that is gathered differently: TP2 (dense
fp32 and bf16, MoE with replicated experts), PP2, PP2xVPP2, EP2, TP2xEP2, TP2xETP2, and at world 4
EP2xETP2 and PP2xEP2. On every rank the bucketed export yields the same (HF name, tensor) pairs in
the same order as upstream's `export_weights_per_parameter`, bit for bit, with one bucket per stage
and with buckets of 64 KiB (its plan cached between exports); and it runs at most 4 collectives per
bucket (counted by wrapping torch.distributed's functions), while upstream's runs several per
parameter.

Pipelined push: a learner at TP2 (rank 0 sends, rank 1 only takes part in the export's gathers) ->
`DistributedWeightSync` with 64 KiB buckets (many buckets: the export of bucket i+1 overlaps the
broadcast of bucket i) -> a stand-in server in its own process (megatron_rl/weights/standin.py) that
joins the update group as SGLang does, receives every `flattened_bucket` broadcast and rebuilds the
tensors from (names, dtypes, shapes). Every received tensor equals upstream's export bit for bit, and
the whole push asks for a number of collectives that grows with the buckets, not with the parameters.

Parameters per rank: the memory estimate's `params_per_rank` (megatron_rl/models/memory.py) against
real Megatron-Core models: each rank's dense and expert parameters (numel) at TP 2 (sequence parallel,
a vocabulary Megatron pads), PP 2, EP 2 and TP 2 x EP 2, the estimate being the rank that holds the
most.

The three parts run one after the other in one spawned process group of 2 (Megatron's parallel state
rebuilt for each layout, as in test_learner_layouts.py): one spawn instead of three. A failure names
its part (`export`, `params per rank`, `push`).
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
# Parameters per rank: {name: (model, parallel)}, on the 300-row vocabulary checkpoints
COUNT_LAYOUTS = {
    "dense_tp2": ("dense_v300", dict(tp=2)),
    "dense_pp2": ("dense_v300", dict(pp=2)),
    "moe_ep2": ("moe_v300", dict(ep=2)),
    "moe_tp2_ep2": ("moe_v300", dict(tp=2, ep=2)),
}
BUCKET = 64 << 10  # the push's buckets


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {"dense": str(make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), num_layers=4)),
            "moe": str(make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), moe=True, num_layers=2)),
            # 300 rows: Megatron pads them to 512 at TP 2 (a multiple of 128 x 2), 384 at TP 1
            "dense_v300": str(make_tiny_checkpoint(tmp_path_factory.mktemp("dense_v300"), vocab_size=300)),
            "moe_v300": str(make_tiny_checkpoint(tmp_path_factory.mktemp("moe_v300"), moe=True, vocab_size=300))}


def count_part(rank, world_size, paths, layouts):
    """Each layout's (dense, expert) parameters (numel) on this rank, in real built models."""
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


def push_part(rank, world_size, hf_path):
    """A learner at TP2 pushes to a stand-in server through DistributedWeightSync (rank 0 sends);
    rank 0 returns upstream's export, what the stand-in received, the push's stats and collectives."""
    import torch.distributed as dist

    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.weights.push import push_weights
    from megatron_rl.weights.standin import StandIn
    from megatron_rl.weights.sync_distributed import DistributedWeightSync

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.parallel = ParallelConfig(tp=2)
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir="/nonexistent")
    ref = [(n, t.clone()) for n, t in learner.bridge.export_weights_per_parameter(learner.model)]
    transport = None
    if rank == 0:
        server = StandIn(keep=True)
        transport = DistributedWeightSync([server], master_addr="127.0.0.1", bucket_bytes=BUCKET)
        transport.connect()
    with counted() as calls:
        stats = push_weights(learner, transport, weight_version="v1", bucket_bytes=BUCKET)
    dist.barrier()
    if rank != 0:
        return None
    transport.close()
    server.proc.join()
    return dict(ref=ref, received=server.received, stats=stats, calls=dict(calls))


def world2_worker(rank, world_size, paths):
    """The world-2 process group: the export's layouts, the parameters per rank, the push."""
    parts = (("export", lambda: export_worker(rank, world_size, paths, {**DENSE, **MOE})),
             ("params per rank", lambda: count_part(rank, world_size, paths, COUNT_LAYOUTS)),
             ("push", lambda: push_part(rank, world_size, paths["dense"])))
    out = {}
    for part, run in parts:
        try:
            out[part] = run()
        except Exception as e:
            raise RuntimeError(f"part {part!r} failed on rank {rank}: {type(e).__name__}: {e}") from e
    return out


def _check(results, layouts):
    for rank_out in results:
        for name in layouts:
            r = rank_out[name]
            # Upstream: several collectives per parameter; here at most 4 per bucket + the plan's one.
            assert r["upstream"] >= 4 * r["n_params"], ("export", name, r)
            for label in ("one", "small"):
                calls = sum(r[label]["calls"].values())
                assert calls <= 1 + 4 * r[label]["buckets"], ("export", name, label, r)
            assert r["small"]["buckets"] > r["one"]["buckets"], ("export", name, r)
            assert sum(r["one"]["calls"].values()) <= 12, ("export", name, r)  # one bucket per stage


def _check_counts(ranks, paths):
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.memory import Layout, model_dims, params_per_rank

    for name, (which, parallel) in COUNT_LAYOUTS.items():
        tp = parallel.get("tp", 1)
        lay = Layout(world_size=2, tp=tp, pp=parallel.get("pp", 1), ep=parallel.get("ep", 1),
                     sequence_parallel=tp > 1)
        built = [r[name] for r in ranks]
        estimated = params_per_rank(model_dims(ModelConfig(hf_path=paths[which])), lay)
        assert estimated == (max(b[0] for b in built), max(b[1] for b in built)), \
            ("params per rank", name, built, estimated)


def _check_push(out):
    ref, received = out["ref"], out["received"]
    assert set(received) == {n for n, _ in ref}, "push: the stand-in did not receive every exported name"
    for name, t in ref:
        got = torch.frombuffer(bytearray(received[name]), dtype=t.dtype).view(t.shape)
        assert torch.equal(got, t), f"push: {name} differs after the push"
    stats, calls = out["stats"], out["calls"]
    assert stats["buckets"] > 5 and stats["bytes"] == sum(t.numel() * t.element_size() for _, t in ref), \
        ("push", stats)
    # The side group's broadcast once per bucket, the export's TP gather once per bucket of its own
    # (the same size): O(buckets), where upstream's export alone asks for several per parameter.
    assert calls.get("broadcast", 0) == stats["buckets"], ("push", calls)
    assert sum(calls.values()) <= 2 * stats["buckets"] + 2, ("push", calls, stats, len(ref))


@pytest.mark.slow
def test_export_push_and_params_per_rank_at_world_2(paths):
    """One process group of 2: the bucketed export is upstream's (every world-2 layout), the
    estimate's parameters per rank are the built models', the pipelined push delivers upstream's
    export to a stand-in server."""
    ranks = run_distributed(world2_worker, 2, paths)
    _check([r["export"] for r in ranks], {**DENSE, **MOE})
    _check_counts([r["params per rank"] for r in ranks], paths)
    _check_push(ranks[0]["push"])


@pytest.mark.slow
def test_bucketed_export_is_upstreams_at_world_4(paths):
    _check(run_distributed(export_worker, 4, paths, WORLD4), WORLD4)
