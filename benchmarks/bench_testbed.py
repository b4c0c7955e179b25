"""The testbed comparison of docs/experiments.md, end to end: base models, every method x seed, the report.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_testbed.py --out runs/testbed

1. `megatron-rl compare --recipe testbed_cpu` (dense Qwen3 base): DPPO binary-TV at δ 0.15 and 0.2,
   binary-KL, top-K TV, GRPO clip-higher (ε 0.2 / 0.28), CISPO, PG-IS (no trust region) and DPPO
   binary-TV anchored on the recomputed π_old (the anchor ablation), 3 seeds each.
   Every method at each learning rate of `--lrs` (default 1e-4 and 2.5e-4: the stable one and one
   where the runs degrade): the same trials for every method.
   `--only fp8`: the same recipe with FP8-rounded rollouts (`rollout.quantization=fp8`) and DRPO
   at δ 12.5 and 0.15 beside the DPPO and baseline methods (docs/experiments.md, "FP8 rollouts").
2. `megatron-rl compare --recipe testbed_moe_cpu` (Qwen3-MoE base, the first learning rate): DPPO
   binary-TV with rollout routing replay (R3) and without.
3. benchmarks/testbed_report.py: the tables and figures (docs/figures/testbed_*.png);
   `--report-only` makes them again from the comparisons already run.

Every run shares everything but the method (compare: Dr.GRPO advantages for all, the recipe's
learning rate, batch, 8 optimizer steps per batch; one hyperparameter trial per method) and logs
its training tokens every `--token-log-every` steps for the token-level analysis. Interrupted, it
continues: finished runs are kept (compare) and the base models are cached (models/base.py).
Budget: the whole benchmark within 2 hours on a 2-core machine (`--parallel 2`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DENSE = [
    "dppo_tv=dppo_binary_tv",
    "dppo_tv_d0.2=dppo_binary_tv +algorithm.loss_kwargs.delta=0.2",
    "dppo_kl=dppo_binary_kl",
    "dppo_topk_tv=dppo_topk_tv",
    "grpo_clip_higher=grpo_clip_higher",
    "cispo=cispo",
    "pg_is=pg_is",
    "dppo_tv_old_anchor=dppo_binary_tv +algorithm.loss_kwargs.anchor=old algorithm.recompute_old_logp=true",
]
# FP8 rollouts (rollout.quantization=fp8: the servers' weights rounded through block-scaled e4m3, the
# learner in float32): the comparison where the mismatch is larger, with DRPO at the paper's
# δ and at DPPO's scale.
FP8 = [
    "dppo_tv=dppo_binary_tv",
    "dppo_topk_tv=dppo_topk_tv",
    "drpo_d12.5=drpo",
    "drpo_d0.15=drpo algorithm.loss_kwargs.delta=0.15",
    "grpo_clip_higher=grpo_clip_higher",
    "cispo=cispo",
    "pg_is=pg_is",
    "dppo_tv_old_anchor=dppo_binary_tv +algorithm.loss_kwargs.anchor=old algorithm.recompute_old_logp=true",
]
MOE = [
    "dppo_tv_r3=dppo_binary_tv algorithm.router_replay=r3",
    "dppo_tv_no_r3=dppo_binary_tv algorithm.router_replay=none",
]


def compare(recipe: str, methods: list[str], out: Path, args, lr: str, extra: tuple = ()) -> None:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "compare", "--recipe", recipe, "--out", str(out),
           "--seeds", str(args.seeds), "--first-seed", str(args.first_seed), "--steps", str(args.steps),
           "--parallel", str(args.parallel), "--target", str(args.target), "--algorithms", ""]
    for m in methods:
        cmd += ["--method", m]
    cmd += [f"optim.lr={lr}", f"trainer.token_log_every={args.token_log_every}", *extra, *args.overrides]
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/testbed")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--token-log-every", type=int, default=5)
    p.add_argument("--lrs", default="1e-4,2.5e-4", help="learning rates every dense method runs at")
    p.add_argument("--only", choices=["dense", "moe", "fp8"], default=None,
                   help="one comparison; fp8 (the FP8-rollout comparison) runs only when named")
    p.add_argument("--report-only", action="store_true", help="the report of the comparisons already run")
    p.add_argument("--figures", default="docs/figures")
    p.add_argument("--target", type=float, default=0.5, help="the accuracy of 'steps to target'")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of every run")
    args = p.parse_args(argv)
    out = Path(args.out)
    start = time.perf_counter()
    done = []
    lrs = args.lrs.split(",")
    for i, lr in enumerate([] if args.report_only else lrs):  # MoE right after the first learning rate
        if args.only in (None, "dense"):
            compare("testbed_cpu", DENSE, out / f"dense_lr{lr}", args, lr)
            done.append(out / f"dense_lr{lr}")
        if args.only == "fp8":
            compare("testbed_cpu", FP8, out / f"fp8_lr{lr}", args, lr, ["rollout.quantization=fp8"])
            done.append(out / f"fp8_lr{lr}")
        if args.only in (None, "moe") and i == 0:
            compare("testbed_moe_cpu", MOE, out / f"moe_lr{lr}", args, lr)
            done.append(out / f"moe_lr{lr}")
    if args.report_only:
        done = sorted(d for d in out.iterdir() if (d / "summary.json").exists())
    wall = time.perf_counter() - start
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "testbed_report.py"), *map(str, done),
                    "--figures", args.figures, "--target", str(args.target), "--out", str(out / "report.md")], check=True, cwd=ROOT)
    print(f"[bench_testbed] all {wall / 60:.1f} min (per comparison: summary.json wall_s); report {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
