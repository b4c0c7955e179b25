"""Command line: `megatron-rl COMMAND [RECIPE] [key=value ...]` (or `python -m megatron_rl.cli`).

Commands:
  demo [OVR]               the embedded default: RL on the tiny task (recipe tiny_cpu), CPU
  train RECIPE [OVR]       the RL trainer; under torchrun / srun every rank runs it
  train-lm RECIPE [OVR]    supervised warm-up run (same launch rules); its checkpoint exports as a
                           train run's does
  dry-run RECIPE [OVR]     validate the config and data, print it, the parallel layout and where the
                           SGLang servers go (checked against the model); launch nothing
  plot RUN_DIR             metrics.jsonl -> RUN_DIR/curves.png
  export RUN_DIR OUT_DIR [--step N] [OVR]
                           a run's newest checkpoint (or step N) -> a Hugging Face folder, at any
                           training layout; one process, or torchrun with parallel.* overrides
  eval MODEL [OVR]         mean@k / pass@k of a HF folder, or of RUN_DIR's newest checkpoint
                           (exported to RUN_DIR/export/step_N), on served samples; no training
  compare [OVR]            several algorithms x seeds on the tiny task, one plot (see tools/compare.py)
  data NAME... [--out DIR] DAPO-Math-17k, AIME 2024/2025, GSM8K, MATH-500 from the hub -> the recipes'
                           Parquet layout with DAPO's prompt template (data/sources.py)

Known upstream notices (Transformer Engine / Apex fallbacks, ...) collapse into one line
(megatron_rl/quiet.py); `--verbose` anywhere on the line, or MRL_VERBOSE=1, shows everything.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_rl import quiet
from megatron_rl.config.load import ConfigError, load_config, to_object


def _dry_run(recipe: str, overrides: list[str], world_size: int | None, command: str, rollout: dict) -> int:
    import torch
    from omegaconf import OmegaConf

    from megatron_rl.data.prompts import load_examples
    from megatron_rl.distributed.context import launch_world, layout_sizes
    from megatron_rl.models.bridge import choose_spec
    from megatron_rl.rollout.placement import layout_report
    from megatron_rl.trainer.preflight import preflight

    cfg = load_config(recipe, overrides)
    job = to_object(cfg)
    # --world-size ($WORLD_SIZE: launchers), else the world the recipe is laid out for, else the
    # smallest that fits
    world_size = world_size or launch_world(job)
    # The checks `train` makes before it starts anything (trainer/preflight.py), in its order.
    ready = preflight(job, command=command, world_size=world_size)
    sizes = layout_sizes(job.parallel, world_size)
    if command == "train":
        resume = ready.resume
        run_folder = (f"run folder: {job.trainer.out_dir} resumes {resume.checkpoint.name}" if resume.checkpoint
                      else f"run folder: {job.trainer.out_dir} starts at step 0")
    if job.data.source == "files":  # read every row now: a bad row fails here, not mid-run
        n_train = len(load_examples(job.data, "train"))
        n_eval = len(load_examples(job.data, "eval")) if job.data.eval_files else 0
        print(f"data: {n_train} training prompts, {n_eval} eval prompts")
    if command == "train-lm":
        servers = ["rollout servers: none (train-lm)"]
    elif job.trainer.mode == "train_only":
        servers = ["rollout servers: none (trainer.mode=train_only)"]
    else:
        servers = layout_report(job, **rollout)
    shown = OmegaConf.to_container(cfg)
    unused = unused_blocks(job, command)
    for key in unused:
        node = shown
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node.pop(last, None)
    print(OmegaConf.to_yaml(OmegaConf.create(shown)))
    if unused:
        print(f"(not used by this run, not shown: {', '.join(unused)})")
    print(f"hardware: {job.hardware}")
    if job.model.spec == "te" and not torch.cuda.is_available():  # planning on a machine without GPUs
        print("layer spec: model.spec=te: not checked here (no CUDA device); the run refuses to start "
              "where transformer_engine does not import")
    else:
        print(choose_spec(job.model.spec).line())
    print("\n".join(servers))
    print(f"layout for world size {world_size}: " + " ".join(f"{k}={v}" for k, v in sizes.items()))
    if command == "train":
        if ready.memory:
            print(ready.memory)
        print(ready.storage)
        print(ready.idle or run_folder)  # the last line: the sbatch says it
    return 0


def unused_blocks(job, command: str) -> list[str]:
    """Config blocks this run does not read (the dry-run leaves them out of its printout)."""
    out = []
    if job.model.hf_path:
        out += ["model.tiny", "model.base"]
    elif job.model.base.sft_steps <= 0:
        out.append("model.base")
    if command != "train-lm":
        out.append("train")
    if job.algorithm.advantage != "gae":
        out.append("critic")
    if not job.reward_model.enabled:
        out.append("reward_model")
    if job.data.source != "synthetic":
        out.append("data.synthetic")
    return out


def _train(recipe: str, overrides: list[str]) -> int:
    from megatron_rl.trainer.loop import train

    job = to_object(load_config(recipe, overrides))
    history = train(job)
    if history and int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
        first, last = history[0], history[-1]
        acc = [h["rollout/accuracy"] for h in history if "rollout/accuracy" in h]
        if acc:
            from megatron_rl.rewards import correct_rule

            print(f"[megatron-rl] train accuracy {acc[0]:.2f} (step {first['step']}) -> {acc[-1]:.2f} "
                  f"(step {last['step']}; {correct_rule(job.data.reward, job.data.correct_threshold)}); "
                  f"metrics in {job.trainer.out_dir}/metrics.jsonl, curves in {job.trainer.out_dir}/curves.png",
                  flush=True)
    return 0


def _train_lm(recipe: str, overrides: list[str]) -> int:
    from megatron_rl.tools import lm_demo
    from megatron_rl.distributed.context import init_distributed

    job = to_object(load_config(recipe, overrides))
    ctx = init_distributed(job.parallel)
    if ctx.rank == 0:
        from megatron_rl.models.bridge import choose_spec

        print(f"[megatron-rl] {job.name}: {ctx.describe()}\n[megatron-rl] {choose_spec(job.model.spec).line()}",
              flush=True)
    history = lm_demo.run(job, ctx)
    if ctx.rank == 0:
        first, last = history[0], history[-1]
        print(f"[megatron-rl] loss {first['loss']:.3f} -> {last['loss']:.3f}; eval greedy accuracy "
              f"{first.get('eval_accuracy', 0):.2f} -> {last.get('eval_accuracy', 0):.2f}; "
              f"metrics in {job.train.out_dir}/metrics.jsonl", flush=True)
    return 0


def _export(argv: list[str]) -> int:
    from megatron_rl.tools.export import export_checkpoint

    parser = argparse.ArgumentParser(prog="megatron-rl export", description=(
        "A run's checkpoint -> a Hugging Face folder (safetensors, config, tokenizer, generation "
        "config). Loads only the model, at this process's layout: one process by default, or "
        "under torchrun with parallel.tp=... / parallel.pp=... / parallel.ep=... overrides."))
    parser.add_argument("run_dir", help="the run's out_dir (config.yaml, checkpoints/)")
    parser.add_argument("out_dir", help="the HF folder to write (must not exist)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint of step N (default: the newest)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run's config, e.g. parallel.tp=2")
    args = parser.parse_intermixed_args(argv)  # --step may follow the overrides
    export_checkpoint(args.run_dir, args.out_dir, args.step, args.overrides)
    return 0


def _eval(argv: list[str]) -> int:
    from megatron_rl.tools.evaluate import main as evaluate

    return evaluate(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the trainer handles it, or a second one (run/signals.py)
        print("\n[megatron-rl] interrupted: no checkpoint of the step in progress (the newest checkpoint, "
              "if any, is where a resume continues)", file=sys.stderr, flush=True)
        if argv is None:  # the console command: stop the servers (atexit), then leave without waiting on
            import atexit  # rollout threads mid-request (their asyncio teardown prints pages)

            atexit._run_exitfuncs()
            sys.stdout.flush()
            os._exit(130)
        return 130


COMMAND_HELP = {
    "train": """usage: megatron-rl train RECIPE [key=value ...]

The RL trainer (one process; under torchrun / srun every rank runs it). RECIPE is recipes/RECIPE.yaml;
overrides are Hydra's (algorithm=cispo, optim.lr=1e-4, trainer.out_dir=runs/x, parallel.tp=2, ...);
`megatron-rl dry-run RECIPE [key=value ...]` prints the composed config and checks it without starting
anything.

The run folder (trainer.out_dir, default runs/<recipe name>) holds one run: launched again it resumes
from its newest checkpoint; a finished run has nothing to do; a launch whose configuration differs
in more than how the run is operated is refused with the differences listed (its own trainer.out_dir,
trainer.resume=false to start over, or trainer.allow_config_change=true). Ctrl-C, SIGTERM and SIGUSR1
stop after the step in progress with a checkpoint.

recipes: {recipes}""",
    "train-lm": """usage: megatron-rl train-lm RECIPE [key=value ...]

Supervised warm-up (no RL) of a tiny model on the synthetic task (e.g. tiny_lm_cpu); its checkpoint
exports as a train run's does.""",
    "dry-run": """usage: megatron-rl dry-run RECIPE [key=value ...] [--world-size N] [--command train|train-lm]
                           [--gpus-per-node N] [--rollout-nodes NAME=ADDR,...] [--rollout-port P]
                           [--rollout-args='...']

Validate without launching anything: the config (typos name the valid keys), the algorithm's
arguments and registry names, the model path, every data row, the learner layout against the
model's shape (heads, KV heads and MLP width vs TP, layers vs PP and VPP, experts vs EP), where the
SGLang servers go; then print the config and the layout. `megatron-rl --help` lists the launcher
options.

recipes: {recipes}""",
    "demo": """usage: megatron-rl demo [key=value ...]

The embedded default: `train tiny_cpu` (RL from random weights on this CPU, a few minutes).""",
    "plot": """usage: megatron-rl plot RUN_DIR

RUN_DIR/metrics.jsonl -> RUN_DIR/curves.png.""",
}


def _command_help(command: str) -> str:
    from megatron_rl.config.load import available_recipes

    return COMMAND_HELP[command].format(recipes=", ".join(available_recipes()))


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in COMMAND_HELP and {"-h", "--help"} & set(argv[1:]):
        print(_command_help(argv[0]))
        return 0
    # Before anything imports megatron-core: its import-time notices collapse into one line.
    if "--verbose" in argv:  # any command; inherited by every process it starts (MRL_VERBOSE)
        argv.remove("--verbose")
        quiet.set_verbose()
    quiet.install()
    if argv[:1] in (["export"], ["eval"]):  # their own options: megatron-rl export --help
        try:
            return (_export if argv[0] == "export" else _eval)(argv[1:])
        except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
            print(f"megatron-rl: error: {e}", file=sys.stderr)
            return 2
    if argv[:1] == ["data"]:  # its own options: megatron-rl data --help
        from megatron_rl.data.sources import main as data

        try:
            return data(argv[1:])
        except (ValueError, FileNotFoundError) as e:
            print(f"megatron-rl: error: {e}", file=sys.stderr)
            return 2
    if argv[:1] == ["fp8-checkpoint"]:  # FP8 rollouts: the block-scaled copy CUDA servers start from
        p = argparse.ArgumentParser(prog="megatron-rl fp8-checkpoint", description=(
            "SRC (a HF checkpoint folder) -> DST: its attention and MLP projections in block-scaled e4m3 "
            "(128x128 blocks, weight_scale_inv), everything else as it is; config.json gets its "
            "quantization_config (rollout.quantization=fp8; megatron_rl/weights/fp8.py)."))
        p.add_argument("src")
        p.add_argument("dst")
        a = p.parse_args(argv[1:])
        from megatron_rl.weights.fp8 import write_fp8_checkpoint

        try:
            print(f"wrote {write_fp8_checkpoint(a.src, a.dst)}")
            return 0
        except (ValueError, FileNotFoundError) as e:
            print(f"megatron-rl: error: {e}", file=sys.stderr)
            return 2
    if argv[:1] == ["compare"]:  # its own options: megatron-rl compare --help
        from megatron_rl.tools.compare import main as compare

        try:
            return compare(argv[1:])
        except (ConfigError, ValueError, FileNotFoundError) as e:
            print(f"megatron-rl: error: {e}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["demo", "train", "train-lm", "dry-run", "plot", "compare",
                                            "export", "eval", "data", "fp8-checkpoint"])
    parser.add_argument("recipe", nargs="?", help="recipe name (recipes/NAME.yaml), or RUN_DIR for plot")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. parallel.tp=2")
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 0)) or None,
                        help="world size assumed by dry-run (default: $WORLD_SIZE, else the recipe's "
                             "parallel.world_size, else the smallest world its layout fits)")
    parser.add_argument("--command", dest="for_command", choices=["train", "train-lm"], default="train",
                        help="dry-run: the command the config is for (train-lm starts no SGLang servers)")
    launch = parser.add_argument_group(
        "dry-run: the servers a launcher (slurm/megatron_rl.sbatch) starts, checked and printed")
    launch.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("GPUS_PER_NODE", 0)) or None,
                        help="GPUs per node: learner ranks per learner node (rank k on GPU k), GPUs per "
                             "rollout node (default: $GPUS_PER_NODE)")
    launch.add_argument("--rollout-nodes", default=None, metavar="NAME=ADDR,...",
                        help="nodes the launcher starts servers on (GPUS_PER_NODE / rollout.server_tp each); "
                             "empty: it starts none; rollout.server_urls must be exactly their URLs")
    launch.add_argument("--rollout-port", type=int, default=30000,
                        help="first server port of a rollout node (server k: + 16 k)")
    launch.add_argument("--rollout-args", default=None, metavar="'--device cuda ...'",
                        help="further SGLang arguments of those servers (ROLLOUT_ARGS; give it as "
                             "--rollout-args='...')")
    args = parser.parse_args(argv)
    try:
        extra = ([args.recipe] if args.recipe else []) + args.overrides
        if args.command == "demo":
            return _train("tiny_cpu", extra)
        if not args.recipe:
            parser.error(f"{args.command} needs a recipe name" if args.command != "plot" else "plot needs RUN_DIR")
        if args.command == "plot":
            from megatron_rl.run.curves import plot_run

            print(plot_run(args.recipe))
            return 0
        if args.command == "dry-run":
            return _dry_run(args.recipe, args.overrides, args.world_size, args.for_command,
                            dict(gpus_per_node=args.gpus_per_node, rollout_nodes=args.rollout_nodes,
                                 rollout_port=args.rollout_port, rollout_args=args.rollout_args))
        if args.command == "train":
            return _train(args.recipe, args.overrides)
        return _train_lm(args.recipe, args.overrides)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"megatron-rl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
