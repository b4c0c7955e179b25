"""How long a training step is held up by a checkpoint: synchronous vs asynchronous saves
(run/checkpoint.py `Checkpointer`), measured on a tiny model here, with the 30B-A3B arithmetic
beside it.

One process (world size 1, gloo), the learner of a tiny Qwen3 (`--model tiny`: 2 layers, hidden 64;
`--model small`: 8 layers, hidden 512, vocab 8192, ~70 MB of checkpoint). For each mode, `--reps`
rounds of: a train step, a save, three more train steps (an asynchronous save is finished at the
first step boundary after its writer is done, as the loop does). Reported per mode (median over the
rounds): the seconds the caller was blocked by the save (`blocked`: `save` plus the polls that
finished it), the forked writer's own seconds after `save` returned (`writer`: what the time limit
reserves beside `blocked`, run/operations.py `save_reserve`), the seconds until the loop saw this
rank's shards on disk (`written`), until the checkpoint was complete (`total`: for an asynchronous
save a step boundary later), and a train step's time with no save around it. Then the 30B-A3B
arithmetic: the checkpoint's size and write times, and the host memory an asynchronous save stages
per node, with the save spread over the replicas (run/checkpoint.py, "Who writes what") and without.

    .venv/bin/python -W ignore benchmarks/bench_checkpoint.py --model small --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {"tiny": dict(num_layers=2), "small": dict(num_layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64,
                                                    ffn=1536, vocab_size=8192)}


def arithmetic_30b() -> None:
    params, ranks, per_node = 30.53e9, 32, 8
    size = params * 14  # bf16 weights 2 + fp32 main weights 4 + Adam moments 2 x 4
    per_rank = size / ranks  # spread: every rank writes about 1/32 (its optimizer shard, a share of the bf16 weights)
    per_node_bytes = per_rank * per_node
    print(f"\n30B-A3B (configs/parallel/h100_moe_4node.yaml: {ranks} learner ranks, {per_node} per node):")
    print(f"  checkpoint {size / 1e9:.0f} GB = 30.53B params x 14 bytes; {per_rank / 1e9:.1f} GB per rank, "
          f"{per_node_bytes / 1e9:.0f} GB per node")
    # Who stages what. Per rank at TP 2 / EP 8 (inside a node) / expert-DP 4 / DP 16: 0.78B dense +
    # 3.62B expert parameters. The distributed optimizer's fp32 state (12 bytes a parameter) is each
    # rank's own: dense over DP 16, experts over expert-DP 4. The bf16 weights are replicated: dense
    # ones over DP 16, expert ones over expert-DP 4 (one rank per node).
    dense, expert, tp, ep, edp, dp = 0.78e9, 3.62e9, 2, 8, 4, 16
    optim_node = (dense / dp + expert / edp) * 12 * per_node
    bf16_experts, bf16_dense = expert * ep * 2, dense * tp * 2  # every expert / dense weight once
    # Unspread: expert-DP rank 0 (node 0) holds the main replica of every expert weight, DP rank 0
    # (ranks 0 and 1, node 0) of every dense one.
    node0 = optim_node + bf16_experts + bf16_dense
    spread = optim_node + (bf16_experts + bf16_dense) / (ranks / per_node)
    print(f"  host memory an asynchronous save stages: unspread, node 0 {node0 / 1e9:.0f} GB (its optimizer "
          f"shards {optim_node / 1e9:.0f} GB + every bf16 expert weight {bf16_experts / 1e9:.0f} GB + every dense "
          f"one {bf16_dense / 1e9:.0f} GB) and {optim_node / 1e9:.0f} GB on the others; spread over the "
          f"replicas, {spread / 1e9:.0f} GB on every node")
    for name, node_gbps in (("parallel file system, 5 GB/s per node", 5.0), ("2 GB/s per node", 2.0),
                            ("an NFS home shared by 4 nodes, 1 GB/s in all", 0.25)):
        print(f"  synchronous: every step with a save blocked {per_node_bytes / 1e9 / node_gbps:5.0f} s ({name})")
    for name, h2d in (("pinned D2H, ~20 GB/s per GPU", 20.0), ("pageable D2H, ~6 GB/s per GPU", 6.0)):
        print(f"  asynchronous: blocked {per_rank / 1e9 / h2d:5.1f} s staging ({name}); the write runs beside "
              f"training and needs {per_node_bytes / 1e9:.0f} GB of host memory per node while it does")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    import torch

    from megatron_rl.config.schema import JobConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.tiny import make_tiny_checkpoint
    from megatron_rl.run.checkpoint import Checkpointer

    tmp = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    hf = make_tiny_checkpoint(tmp / "model", **MODELS[args.model])
    cfg = JobConfig()
    cfg.model.hf_path = str(hf)
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir=str(tmp / "run"))
    g = torch.Generator().manual_seed(0)
    vocab = MODELS[args.model].get("vocab_size", 256)

    def step() -> float:
        ids = torch.randint(3, vocab - 1, (8, 64), generator=g)
        start = time.perf_counter()
        learner.train_step(dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=torch.ones(8, 64)))
        return time.perf_counter() - start

    step()
    print(f"model {args.model}: {sum(p.numel() for m in learner.model for p in m.parameters()) / 1e6:.1f}M params, "
          f"{args.reps} rounds per mode")
    results = {}
    for mode in ("sync", "async"):
        ckpt = Checkpointer(tmp / mode, keep=2, async_save=mode == "async", name=mode)
        rows, steps = [], []
        for r in range(args.reps):
            steps.append(step())
            ckpt.save(learner, r + 1, {"step": r + 1})
            for _ in range(3):
                steps.append(step())
                ckpt.poll()
            ckpt.wait()
            rows.append(dict(ckpt.last))
        results[mode] = {k: statistics.median(row[k] for row in rows)
                         for k in ("blocked_s", "writer_s", "written_s", "total_s")}
        results[mode]["step_s"] = statistics.median(steps)
        m = results[mode]
        print(f"  {mode:5s}: blocked {m['blocked_s']:.3f} s, writer {m['writer_s']:.3f} s, written "
              f"{m['written_s']:.3f} s, complete {m['total_s']:.3f} s; a train step {m['step_s']:.3f} s")
    print(f"  blocked, async / sync: {results['async']['blocked_s'] / results['sync']['blocked_s']:.2f}")
    arithmetic_30b()


if __name__ == "__main__":
    main()
