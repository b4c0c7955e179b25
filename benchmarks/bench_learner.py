"""Tokens/s of one learner train step at TP=1 vs TP=2 vs PP=2 (and DP=2) on CPU over gloo.

Every layout gets the same total CPU threads (threads per process = --threads // world size), the
same global batch and the same model, so the ratios show what each parallel layout costs on this
machine. Run:  .venv/bin/python benchmarks/bench_learner.py [--model tiny|small] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.distributed.spawn import run_distributed  # noqa: E402
from megatron_rl.models.tiny import make_tiny_checkpoint  # noqa: E402

MODELS = {
    "tiny": dict(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128),
    "small": dict(num_layers=4, hidden=256, heads=8, kv_heads=4, head_dim=32, ffn=768, vocab_size=1024),
}


def worker(rank, world_size, hf_path, parallel, threads, batch, seq, mbs, steps):
    torch.set_num_threads(threads)
    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.parallel = ParallelConfig(**parallel)
    cfg.optim.lr = 1e-4
    cfg.learner.micro_batch_size = mbs
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir="/nonexistent")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (batch, seq), generator=g)
    data = dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=torch.ones(batch, seq))
    times = []
    for i in range(steps + 2):
        torch.distributed.barrier()
        start = time.perf_counter()
        learner.train_step(data)
        torch.distributed.barrier()
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    layouts = [("TP=1", 1, {}), ("TP=2", 2, {"tp": 2}), ("PP=2", 2, {"pp": 2}), ("DP=2", 2, {})]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / args.model, **MODELS[args.model])
        rows = []
        for name, world, parallel in layouts:
            times = run_distributed(worker, world, str(path), parallel, max(1, args.threads // world),
                                    args.batch, args.seq, args.micro_batch, args.steps)[0]
            t = statistics.median(times)
            rows.append((name, t, args.batch * args.seq / t))
    base = rows[0][2]
    print(f"model={args.model} batch={args.batch}x{args.seq} tokens micro_batch={args.micro_batch} "
          f"threads={args.threads} steps={args.steps} (median)")
    print(f"{'layout':<8}{'step s':>10}{'tokens/s':>12}{'vs TP=1':>10}")
    for name, t, tps in rows:
        print(f"{name:<8}{t:>10.3f}{tps:>12.0f}{tps / base:>10.2f}")


if __name__ == "__main__":
    main()
