"""Command line: `megatron-rl COMMAND [RECIPE] [key=value ...]` (or `python -m megatron_rl.cli`).

Commands:
  demo                     the embedded default (recipe tiny_lm_cpu on this machine's CPU)
  train-lm RECIPE [OVR]    supervised warm-up run; under torchrun / srun every rank runs it
  dry-run RECIPE [OVR]     validate the config, print it and the parallel layout; launch nothing
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_rl.config.load import ConfigError, load_config, to_object


def _dry_run(recipe: str, overrides: list[str], world_size: int) -> int:
    from omegaconf import OmegaConf

    from megatron_rl.distributed.context import layout_sizes

    cfg = load_config(recipe, overrides)
    job = to_object(cfg)
    sizes = layout_sizes(job.parallel, world_size)
    print(OmegaConf.to_yaml(cfg))
    print(f"layout for world size {world_size}: " + " ".join(f"{k}={v}" for k, v in sizes.items()))
    return 0


def _train_lm(recipe: str, overrides: list[str]) -> int:
    from megatron_rl import lm_demo
    from megatron_rl.distributed.context import init_distributed

    job = to_object(load_config(recipe, overrides))
    ctx = init_distributed(job.parallel)
    if ctx.rank == 0:
        print(f"[megatron-rl] {job.name}: {ctx.describe()}", flush=True)
    history = lm_demo.run(job, ctx)
    if ctx.rank == 0:
        first, last = history[0], history[-1]
        print(f"[megatron-rl] loss {first['loss']:.3f} -> {last['loss']:.3f}; eval greedy accuracy "
              f"{first.get('eval_accuracy', 0):.2f} -> {last.get('eval_accuracy', 0):.2f}; "
              f"metrics in {job.train.out_dir}/metrics.jsonl", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["demo", "train-lm", "dry-run"])
    parser.add_argument("recipe", nargs="?", help="recipe name (recipes/NAME.yaml)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallel.tp=2")
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                        help="world size assumed by dry-run (default: $WORLD_SIZE or 1)")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return _train_lm("tiny_lm_cpu", ([args.recipe] if args.recipe else []) + args.overrides)
        if not args.recipe:
            parser.error(f"{args.command} needs a recipe name")
        if args.command == "dry-run":
            return _dry_run(args.recipe, args.overrides, args.world_size)
        return _train_lm(args.recipe, args.overrides)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"megatron-rl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
