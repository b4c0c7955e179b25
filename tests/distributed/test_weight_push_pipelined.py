"""A pipelined push over the process-group transport delivers exactly mbridge's per-parameter export.

Learner at TP2 (two gloo ranks; rank 0 sends, rank 1 only takes part in the export's gathers) ->
`DistributedWeightSync` with 64 KiB buckets (many buckets: the export of bucket i+1 overlaps the
broadcast of bucket i) -> a stand-in server in its own process that joins the update group as
SGLang does, receives every `flattened_bucket` broadcast and rebuilds the tensors from (names,
dtypes, shapes). Every received tensor equals upstream's export bit for bit, and the whole push
asks for a number of collectives that grows with the buckets, not with the parameters.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

BUCKET = 64 << 10


def stand_in(conn) -> None:
    """The server's side of the update group: receives each bucket and keeps its tensors."""
    import torch.distributed as dist

    from megatron_rl.weights.process_group import new_side_group

    group, received = None, {}
    while True:
        path, p = conn.recv()
        if path == "/init_weights_update_group":
            group = new_side_group(p["backend"], f"tcp://{p['master_address']}:{p['master_port']}",
                                   world_size=p["world_size"], rank=p["rank_offset"], group_name=p["group_name"])
        elif path == "/update_weights_from_distributed":
            assert p["load_format"] == "flattened_bucket"
            sizes = [math.prod(s) * getattr(torch, d).itemsize for s, d in zip(p["shapes"], p["dtypes"])]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=group)
            for name, shape, dtype, part in zip(p["names"], p["shapes"], p["dtypes"], flat.split(sizes)):
                assert name not in received, f"{name} sent twice"
                received[name] = part.view(getattr(torch, dtype)).view(shape).clone()
        elif path == "/destroy_weights_update_group":
            dist.destroy_process_group(group)
            conn.send({n: t.numpy().tobytes() for n, t in received.items()})
            return
        conn.send({})


class StandIn:
    url, tp_size = "stand-in", 1

    def __init__(self):
        import threading

        import torch.multiprocessing as mp

        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=stand_in, args=(child,))
        self.proc.start()
        self.lock = threading.Lock()

    def post(self, path, payload=None, timeout=600.0):
        with self.lock:
            self.conn.send((path, payload or {}))
            reply = self.conn.recv()
        if path == "/destroy_weights_update_group":
            self.received, reply = reply, {}  # what the stand-in got, kept for the test
        return reply


def push_worker(rank, world_size, hf_path):
    import torch.distributed as dist

    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.weights.push import push_weights
    from megatron_rl.weights.sync_distributed import DistributedWeightSync
    from test_weight_export import counted  # this folder's module: spawned ranks keep sys.path

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.parallel = ParallelConfig(tp=2)
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir="/nonexistent")
    ref = [(n, t.clone()) for n, t in learner.bridge.export_weights_per_parameter(learner.model)]
    transport = None
    if rank == 0:
        server = StandIn()
        transport = DistributedWeightSync([server], master_addr="127.0.0.1", bucket_bytes=BUCKET)
        transport.connect()
    with counted() as calls:
        stats = push_weights(learner, transport, weight_version="v1", bucket_bytes=BUCKET)
    dist.barrier()
    if rank != 0:
        return None
    transport.close()
    server.proc.join()
    received = server.received
    return dict(ref=ref, received=received, stats=stats, calls=dict(calls))


@pytest.mark.slow
def test_pipelined_push_delivers_upstreams_export(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "dense", num_layers=4)
    out = run_distributed(push_worker, 2, str(path))[0]
    ref, received = out["ref"], out["received"]
    assert set(received) == {n for n, _ in ref}
    for name, t in ref:
        got = torch.frombuffer(bytearray(received[name]), dtype=t.dtype).view(t.shape)
        assert torch.equal(got, t), f"{name} differs after the push"
    stats, calls = out["stats"], out["calls"]
    assert stats["buckets"] > 5 and stats["bytes"] == sum(t.numel() * t.element_size() for _, t in ref)
    # The side group's broadcast once per bucket, the export's TP gather once per bucket of its own
    # (the same size): O(buckets), where upstream's export alone asks for several per parameter.
    assert calls.get("broadcast", 0) == stats["buckets"], calls
    assert sum(calls.values()) <= 2 * stats["buckets"] + 2, (calls, stats, len(ref))
