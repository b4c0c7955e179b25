"""Weight-sync time and bytes/s, learner -> one SGLang CPU server, against a memcpy of the same bytes.

Transports: process group (gloo broadcast of flattened buckets) and tensor handles (shared
memory over HTTP). Baseline: one `torch.cat` copy of every exported tensor (a plain memcpy of the
same bytes in this process). Each is the median of --reps pushes after one warm-up.

    .venv/bin/python -W ignore benchmarks/bench_weight_sync.py [--hidden 512 --layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    args = ap.parse_args()

    import torch.distributed as dist

    from megatron_rl.config.schema import JobConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.distributed.spawn import free_port
    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.tiny import make_tiny_checkpoint
    from megatron_rl.rollout.server import EngineManager, ServerConfig
    from megatron_rl.weights.endpoint import ServerEndpoint
    from megatron_rl.weights.push import push_weights
    from megatron_rl.weights.sync_distributed import DistributedWeightSync
    from megatron_rl.weights.sync_tensor import TensorWeightSync

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "m", num_layers=args.layers, hidden=args.hidden,
                                    heads=8, kv_heads=4, head_dim=args.hidden // 8, ffn=3 * args.hidden,
                                    vocab_size=args.vocab)
        with EngineManager(ServerConfig(model_path=str(ckpt), max_total_tokens=1024), 1,
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
            memcpy = []
            for _ in range(args.reps + 1):
                start = time.perf_counter()
                torch.cat([t.reshape(-1) for t in tensors])
                memcpy.append(time.perf_counter() - start)
            rows = [("memcpy (torch.cat of the same tensors)", statistics.median(memcpy[1:]))]

            dist_sync = DistributedWeightSync([endpoint], master_addr="127.0.0.1", master_port=free_port(),
                                              bucket_bytes=bucket)
            dist_sync.connect()
            for name, transport in [("process group (gloo broadcast)", dist_sync),
                                    ("tensor handles (shared memory)", TensorWeightSync([endpoint], bucket_bytes=bucket))]:
                times = []
                for _ in range(args.reps + 1):
                    start = time.perf_counter()
                    push_weights(learner, transport)
                    times.append(time.perf_counter() - start)
                rows.append((name, statistics.median(times[1:])))
            dist_sync.close()

    base = rows[0][1]
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {nbytes / 2**20:.1f} MiB fp32; "
          f"bucket {args.bucket_mb} MiB; median of {args.reps} (export + send + server load + flush)")
    print(f"{'path':<42}{'s':>9}{'MiB/s':>10}{'x memcpy time':>15}")
    for name, t in rows:
        print(f"{name:<42}{t:>9.3f}{nbytes / 2**20 / t:>10.0f}{t / base:>15.1f}")


if __name__ == "__main__":
    main()
