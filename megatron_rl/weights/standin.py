"""A stand-in rollout server for the process-group weight push: a process that joins the update
group as SGLang does and receives every `flattened_bucket` broadcast, without SGLang.

Used by tests/distributed/test_weight_export.py (which keeps the received tensors and compares
them with mbridge's export) and benchmarks/bench_weight_sync.py (which drops them: the learner's
side of a push alone). `StandIn` looks like a `ServerEndpoint` to `DistributedWeightSync`: its
`post` goes down a pipe to the process instead of over HTTP.
"""

from __future__ import annotations

import math
import threading

import torch


def serve(conn, keep: bool) -> None:
    """The server's side of the update group: answers `StandIn.post` until the group is destroyed.
    With `keep`, rebuilds each bucket's tensors from (names, dtypes, shapes) and sends them all back
    (name -> bytes) in answer to the destroy; without, receives each bucket and drops it."""
    import torch.distributed as dist

    from megatron_rl.weights.process_group import new_side_group

    group, received = None, {}
    while True:
        path, p = conn.recv()
        if path == "/init_weights_update_group":
            group = new_side_group(p["backend"], f"tcp://{p['master_address']}:{p['master_port']}",
                                   world_size=p["world_size"], rank=p["rank_offset"], group_name=p["group_name"])
        elif path == "/update_weights_from_distributed":
            assert p["load_format"] == "flattened_bucket", p["load_format"]
            sizes = [math.prod(s) * getattr(torch, d).itemsize for s, d in zip(p["shapes"], p["dtypes"])]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)  # allocated per bucket, as a server does
            dist.broadcast(flat, src=0, group=group)
            if keep:
                for name, shape, dtype, part in zip(p["names"], p["shapes"], p["dtypes"], flat.split(sizes)):
                    assert name not in received, f"{name} sent twice"
                    received[name] = part.view(getattr(torch, dtype)).view(shape).clone()
        elif path == "/destroy_weights_update_group":
            dist.destroy_process_group(group)
            conn.send({n: t.numpy().tobytes() for n, t in received.items()})
            return
        conn.send({})


class StandIn:
    """A ServerEndpoint look-alike whose server is `serve` in its own (spawned) process. After the
    group's destroy, `received` holds what it got ({name: bytes}; empty unless `keep`)."""

    url, tp_size = "stand-in", 1

    def __init__(self, keep: bool = False):
        import torch.multiprocessing as mp

        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=serve, args=(child, keep))
        self.proc.start()
        self.lock = threading.Lock()
        self.received: dict[str, bytes] = {}

    def post(self, path: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
        with self.lock:
            self.conn.send((path, payload or {}))
            reply = self.conn.recv()
        if path == "/destroy_weights_update_group":
            self.received, reply = reply, {}
        return reply
