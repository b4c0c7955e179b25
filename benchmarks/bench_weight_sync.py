"""Weight-sync time and bytes/s, learner -> one SGLang CPU server, against a plain broadcast and a
memcpy of the same bytes.

Rows:
- memcpy: one `torch.cat` copy of every exported tensor in this process;
- plain broadcast: the push's flat buckets, already made, broadcast over a gloo group of this
  process and one receiving process (loopback TCP; the receiver allocates each bucket, as a server
  does) - the transfer alone, nothing exported, nothing loaded;
- export only: the learner's weights as HF tensors, mbridge's per-parameter export
  (`export_weights_per_parameter`, kept by patches/mbridge_fixes.py) and the bucketed one
  (models/weight_export.py), consumed and dropped;
- push to a stand-in server: the process-group transport (export, flat buckets, pipelined
  broadcast) to a process that joins the update group and receives every bucket as a server does,
  but loads nothing: the learner's side of a push, what the target is about;
  beside it the same push with its host copies on every intra-op thread (weights/push.py
  `_serial_host_copies` disabled: the code before it), in the same run;
- the pushes to SGLang: process group (gloo broadcast of flattened buckets, pipelined) and tensor
  handles (shared memory over HTTP): export + transfer + the server loading the weights + cache
  flush. On CPU the server's own `load_weights` (its copies into its parameters, in the server
  process, on the same cores) is most of the difference to the stand-in.

Each figure is the median of --reps after one warm-up. The target (issue 41): a push at >= 50 % of
the plain broadcast's bandwidth for the same bytes.

    .venv/bin/python -W ignore benchmarks/bench_weight_sync.py [--hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _receive(addr: str, port: int, group_name: str, sizes: list[int], rounds: int) -> None:
    """The plain broadcast's receiving rank: `rounds` times, one buffer per bucket."""
    import torch.distributed as dist

    from megatron_rl.weights.process_group import new_side_group

    group = new_side_group("gloo", f"tcp://{addr}:{port}", world_size=2, rank=1, group_name=group_name)
    for _ in range(rounds):
        for n in sizes:
            dist.broadcast(torch.empty(n, dtype=torch.uint8), src=0, group=group)
    dist.destroy_process_group(group)


def plain_broadcast(flats: list[torch.Tensor], rounds: int) -> list[float]:
    """Seconds of each round of broadcasting `flats` to one receiving process over gloo."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from megatron_rl.weights.process_group import host_store, new_side_group

    store = host_store("127.0.0.1", 2)
    receiver = mp.get_context("spawn").Process(
        target=_receive, args=("127.0.0.1", store.port, "bench_plain", [f.numel() for f in flats], rounds))
    receiver.start()
    group = new_side_group("gloo", f"tcp://127.0.0.1:{store.port}", world_size=2, rank=0,
                           group_name="bench_plain", store=store)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for f in flats:
            dist.broadcast(f, src=0, group=group)
        times.append(time.perf_counter() - start)
    receiver.join()
    dist.destroy_process_group(group)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=8)  # 8+ buckets: the pipeline runs
    ap.add_argument("--server-omp", default=None, metavar="POLICY",
                    help="the SGLang server's OMP_WAIT_POLICY (default: what rollout/server.py gives a CPU "
                         "server, PASSIVE; 'default' is libgomp's own, its threads spinning when idle)")
    args = ap.parse_args()

    from megatron_rl.config.schema import JobConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.distributed.spawn import free_port
    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.tiny import make_tiny_checkpoint
    from megatron_rl.rollout.server import EngineManager, ServerConfig
    from megatron_rl.weights.buckets import bucketize
    from megatron_rl.weights.endpoint import ServerEndpoint
    from megatron_rl.weights import push as push_module
    from megatron_rl.weights.push import push_weights
    from megatron_rl.weights.standin import StandIn  # shared with tests/distributed/test_weight_export.py
    from megatron_rl.weights.sync_distributed import DistributedWeightSync
    from megatron_rl.weights.sync_tensor import TensorWeightSync

    def median_of(fn) -> float:
        times = []
        for _ in range(args.reps + 1):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "m", num_layers=args.layers, hidden=args.hidden,
                                    heads=8, kv_heads=4, head_dim=args.hidden // 8, ffn=3 * args.hidden,
                                    vocab_size=args.vocab)
        with EngineManager(ServerConfig(model_path=str(ckpt), max_total_tokens=1024,
                                        env={"OMP_WAIT_POLICY": args.server_omp} if args.server_omp else {}), 1,
                           log_dir=Path(tmp) / "logs") as mgr:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
            cfg = JobConfig()
            cfg.model.hf_path = str(ckpt)
            ctx = init_distributed(cfg.parallel)
            learner = Learner(cfg, ctx, run_dir=tmp)
            endpoint = ServerEndpoint(mgr.urls()[0])
            bucket = args.bucket_mb << 20

            tensors = [t.clone() for _, t in learner.export_hf_weights()]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            rows = [("memcpy (torch.cat of the same tensors)",
                     median_of(lambda: torch.cat([t.reshape(-1) for t in tensors])))]
            flats = [b.flatten() for b in bucketize(learner.export_hf_weights(), bucket)]
            rows.append(("plain broadcast (gloo, same buckets)",
                         statistics.median(plain_broadcast(flats, args.reps + 1)[1:])))
            del flats
            bridge = learner.bridge
            if hasattr(bridge, "export_weights_per_parameter"):
                rows.append(("export only, mbridge per parameter", median_of(
                    lambda: [None for _ in bridge.export_weights_per_parameter(learner.model)])))
            rows.append(("export only (learner.export_hf_weights)", median_of(
                lambda: [None for _ in learner.export_hf_weights()])))

            # The export gathers in buckets of the transport's size (an earlier checkout's
            # push_weights, measured for a before/after, has no such argument).
            kw = {"bucket_bytes": bucket} if "bucket_bytes" in inspect.signature(push_weights).parameters else {}
            stand_in = StandIn()
            to_stand_in = DistributedWeightSync([stand_in], master_addr="127.0.0.1", bucket_bytes=bucket)
            to_stand_in.connect()
            rows.append(("push to a stand-in server (loads nothing)",
                         median_of(lambda: push_weights(learner, to_stand_in, **kw))))
            if hasattr(push_module, "_serial_host_copies"):  # the same, its copies on every thread
                serial = push_module._serial_host_copies
                push_module._serial_host_copies = lambda _learner: contextlib.nullcontext()
                try:
                    rows.append(("  the same, copies on every intra-op thread",
                                 median_of(lambda: push_weights(learner, to_stand_in, **kw))))
                finally:
                    push_module._serial_host_copies = serial
            to_stand_in.close()
            stand_in.proc.join()

            dist_sync = DistributedWeightSync([endpoint], master_addr="127.0.0.1", master_port=free_port(),
                                              bucket_bytes=bucket)
            dist_sync.connect()
            for name, transport in [("push: process group (gloo broadcast)", dist_sync),
                                    ("push: tensor handles (shared memory)",
                                     TensorWeightSync([endpoint], bucket_bytes=bucket))]:
                rows.append((name, median_of(lambda: push_weights(learner, transport, **kw))))
            dist_sync.close()

    memcpy, bcast = rows[0][1], rows[1][1]
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {nbytes / 2**20:.1f} MiB fp32; "
          f"bucket {args.bucket_mb} MiB; median of {args.reps}")
    print(f"{'path':<44}{'s':>9}{'MiB/s':>10}{'x memcpy':>10}{'% of broadcast MiB/s':>22}")
    for name, t in rows:
        print(f"{name:<44}{t:>9.3f}{nbytes / 2**20 / t:>10.0f}{t / memcpy:>10.1f}{100 * bcast / t:>21.0f}%")


if __name__ == "__main__":
    main()
