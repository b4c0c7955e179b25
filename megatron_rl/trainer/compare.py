"""`megatron-rl compare`: several algorithms x seeds on the tiny task, one plot.

The small-scale analogue of the DPPO paper's comparison figures: every (algorithm, seed) run is a
normal `train` run of the recipe (default tiny_cpu) with `algorithm=<name>` and the seed applied
to the model init, the sampling and the prompt order. All runs share one SGLang server (each run
starts by pushing its own weights to it), so only one server start-up is paid.

    megatron-rl compare --algorithms dppo_binary_tv,grpo_clip_higher,cispo,pg_is --seeds 3 --steps 40
    -> runs/compare/<algorithm>/seed<k>/..., runs/compare/accuracy.png, runs/compare/summary.json

`--first-seed F` runs seeds F .. F + seeds − 1 (e.g. `--first-seed 3 --seeds 2` adds seeds 3 and 4
to an earlier 3-seed comparison). `pg_is` (configs/algorithm/pg_is.yaml) is the no-trust-region
baseline: −A·π/μ with Dr.GRPO advantages, as DPPO's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from megatron_rl.config.load import load_config, to_object
from megatron_rl.trainer.metrics import read_metrics
from megatron_rl.trainer.plot import plot_compare

DEFAULT_ALGORITHMS = "dppo_binary_tv,dppo_binary_kl,grpo_clip_higher,cispo"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-rl compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="tiny_cpu")
    p.add_argument("--algorithms", default=DEFAULT_ALGORITHMS, help="comma-separated configs/algorithm names")
    p.add_argument("--seeds", type=int, default=3, help="runs per algorithm")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds first-seed .. first-seed + seeds - 1 (more seeds later without rerunning these)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="runs/compare")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run")
    args = p.parse_args(argv)
    algorithms = [a for a in args.algorithms.split(",") if a]
    out = Path(args.out)
    # Validate every combination before starting anything.
    for a in algorithms:
        to_object(load_config(args.recipe, [f"algorithm={a}", *args.overrides]))
    job = to_object(load_config(args.recipe, args.overrides))

    from megatron_rl.models.tiny import make_tiny_checkpoint
    from megatron_rl.rollout.server import EngineManager, ServerConfig
    from megatron_rl.trainer.rollouts import server_extra_args

    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_tiny_checkpoint(out / "server_model", **vars(job.model.tiny))
    runs: dict[str, list[Path]] = {}
    r = job.rollout
    # The runs' seeded sampling needs the server's deterministic mode (server_extra_args).
    with EngineManager(ServerConfig(model_path=str(ckpt), dtype="float32", max_total_tokens=r.max_total_tokens,
                                    extra_args=server_extra_args(job)), 1, log_dir=out / "server_logs") as mgr:
        for a in algorithms:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                run_dir = out / a / f"seed{seed}"
                cmd = [sys.executable, "-m", "megatron_rl.cli", "train", args.recipe, f"algorithm={a}",
                       f"trainer.steps={args.steps}", f"trainer.seed={seed}", f"data.shuffle_seed={seed}",
                       f"model.tiny.seed={seed}", f"trainer.out_dir={run_dir}", "trainer.resume=false",
                       f"rollout.server_urls=[{mgr.urls()[0]}]", "trainer.progress=false", *args.overrides]
                print(f"[compare] {a} seed {seed} -> {run_dir}", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if len(algorithms) * args.seeds > 1 else None)
                runs.setdefault(a, []).append(run_dir)
    png = plot_compare(runs, out / "accuracy.png")
    summary = {}
    for a, dirs in runs.items():
        finals = [[m for m in read_metrics(d) if m["step"] >= 0][-1]["rollout/accuracy"] for d in dirs]
        summary[a] = {"final_train_accuracy": finals, "mean": sum(finals) / len(finals)}
        print(f"[compare] {a:20s} final train accuracy " + " ".join(f"{x:.2f}" for x in finals)
              + f"  mean {summary[a]['mean']:.2f}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[compare] plot: {png}")
    return 0
