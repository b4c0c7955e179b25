"""`megatron-rl compare`: several methods x seeds on one recipe, one plot, one summary.

The small-scale analogue of the DPPO paper's comparison figures: every (method, seed) run is a
normal `train` run of the recipe (default tiny_cpu) with the method's overrides and the seed applied
to the sampling and the prompt order (and to the model init when the recipe starts from random
weights; a recipe with a base stage, model.base, starts every run from the same cached base). All
runs share one SGLang server (each run starts by pushing its own weights to it), so only one server
start-up is paid; `--parallel N` starts N servers, one per run in flight.

    megatron-rl compare --recipe testbed_cpu --seeds 3 --steps 40
    -> runs/compare/testbed_cpu/<method>/seed<k>/..., .../accuracy.png, .../summary.json

A method is `--algorithms NAME` (configs/algorithm/NAME.yaml) or `--method LABEL=NAME [OVERRIDE ...]`
for a variant, e.g. `--method "dppo_tv_d0.2=dppo_binary_tv +algorithm.loss_kwargs.delta=0.2"`.
The comparison is fair by construction: every run gets `algorithm.advantage=<--advantage>` (default
dr_grpo, the DPPO paper's estimator), so methods differ only in the policy loss and its trust
region, and each method is run at the hyperparameters given here, once: the summary records that
trial budget (1 per method) beside the results. The default set is the paper's methods.

`--first-seed F` runs seeds F .. F + seeds − 1 (e.g. `--first-seed 3 --seeds 2` adds seeds 3 and 4
to an earlier 3-seed comparison). A run folder that holds a finished run of exactly the configuration
this comparison would run (every experiment key of its checkpoint's config, and the steps) is kept, so
an interrupted comparison continues where it stopped; one made with other settings (another learning
rate, recipe, seed rule, ...) is run again, and the line says what differed. `--parallel N` runs N at once, each against a
server of its own (a run owns its server's weights), each with 1/N of the CPU threads.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_rl.config.load import load_config, to_object
from megatron_rl.run.metrics import read_metrics
from megatron_rl.tools.plot import plot_compare
from megatron_rl.run.run_dir import as_dict

DEFAULT_ALGORITHMS = "dppo_binary_tv,dppo_binary_kl,dppo_topk_tv,grpo_clip_higher,cispo,pg_is"
# Metrics the summary reports per method (means over seeds; per-seed values beside them).
TARGET = 0.8  # steps-to-target accuracy (of the run's best; see summarize)


def parse_methods(algorithms: str, methods: list[str]) -> dict[str, list[str]]:
    """{label: overrides}: `--algorithms a,b` and `--method LABEL=NAME [OVERRIDE ...]`."""
    out: dict[str, list[str]] = {}
    for a in (a for a in algorithms.split(",") if a):
        out[a] = [f"algorithm={a}"]
    for m in methods:
        label, sep, rest = m.partition("=")
        words = shlex.split(rest)
        if not sep or not label or not words:
            raise ValueError(f"--method {m!r}: expected LABEL=NAME [OVERRIDE ...]")
        if label in out:
            raise ValueError(f"--method {m!r}: the label {label!r} is used twice")
        out[label] = [f"algorithm={words[0]}", *words[1:]]
    if not out:
        raise ValueError("no methods: give --algorithms and/or --method")
    return out


def _finished(run_dir: Path, steps: int) -> bool:
    try:
        rows = [m for m in read_metrics(run_dir) if m["step"] >= 0]
    except FileNotFoundError:
        return False
    return bool(rows) and rows[-1]["step"] >= steps - 1


def default_out(recipe: str) -> Path:
    """A comparison's folder when --out is not given: one per recipe, so that comparisons of two
    recipes never meet (each would take the other's finished runs for its own); under $MRL_RUNS
    (default ./runs), where runs go."""
    return Path(os.environ.get("MRL_RUNS", "runs")) / "compare" / recipe


def reusable(run_dir: Path, steps: int, wanted: dict) -> tuple[bool, str]:
    """(keep it, why not): a run folder is this comparison's run only if it finished and its newest
    checkpoint was written by exactly the configuration this comparison would run now (every
    experiment key equal, and as many steps)."""
    from megatron_rl.run.checkpoint import latest_checkpoint
    from megatron_rl.run.run_dir import differences, saved_config

    if not _finished(run_dir, steps):
        return False, "not finished"
    ckpt = latest_checkpoint(run_dir)
    saved = saved_config(ckpt) if ckpt is not None else None
    if saved is None:
        return False, "no checkpoint with its configuration"
    changed, _ = differences(saved, wanted)
    ran = saved.get("trainer", {}).get("steps")
    if ran != steps:
        changed.append(f"trainer.steps: {ran!r} -> {steps!r}")
    return not changed, "; ".join(changed)


def collapse_events(acc: list[float], frac: float = 0.5, span: int = 5) -> int:
    """Collapses: stretches of >= `span` consecutive steps whose accuracy is below `frac` of the
    best accuracy reached so far (each stretch counts once). Relative, so that a base at 0.27 that
    falls to 0.05 collapses as surely as a run at 0.9 that falls to 0.4."""
    best, run, events = float("-inf"), 0, 0
    for a in acc:
        best = max(best, a)
        run = run + 1 if a < frac * best else 0
        events += run == span
    return events


def smoothed(acc: list[float], window: int = 5) -> list[float]:
    """Trailing mean over `window` steps (fewer at the start): per-step accuracy over 32 prompts
    is noisy (± ~0.08), so 'steps to target' reads this."""
    return [sum(acc[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(acc))]


def summarize(run_dir: Path, target: float = TARGET) -> dict:
    """A run's accuracy figures from its train accuracy per step: the first step whose 5-step
    trailing mean reaches `target`, the mean of the last 5 steps (final), the best step, collapse
    events; the eval's last mean@k; the mean train/inference mismatch."""
    # Training rows (an evaluation that ended beside training at the last step has a row of its own).
    rows = [m for m in read_metrics(run_dir) if m["step"] >= 0 and "rollout/accuracy" in m]
    acc = [m["rollout/accuracy"] for m in rows]
    hit = next((m["step"] for m, a in zip(rows, smoothed(acc)) if a >= target), None)
    evals = [next(v for k, v in m.items() if k.startswith("eval/mean@")) for m in read_metrics(run_dir)
             if any(k.startswith("eval/mean@") for k in m)]
    tail = acc[-5:]
    mism = [m["mismatch/train_vs_rollout_abs_logp"] for m in rows if "mismatch/train_vs_rollout_abs_logp" in m]
    return {"final": sum(tail) / len(tail), "best": max(acc), "first": acc[0], "steps_to_target": hit,
            "collapses": collapse_events(acc), "eval_final": evals[-1] if evals else None,
            "mismatch": sum(mism) / len(mism) if mism else None}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-rl compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="tiny_cpu")
    p.add_argument("--algorithms", default=None,
                   help=f"comma-separated configs/algorithm names (default without --method: {DEFAULT_ALGORITHMS})")
    p.add_argument("--method", action="append", default=[], metavar="LABEL=NAME [OVERRIDE ...]",
                   help="a method variant: an algorithm config and overrides of it (repeatable)")
    p.add_argument("--advantage", default="dr_grpo",
                   help="the advantage estimator every run uses (the comparison's shared part); "
                        "'config' keeps each algorithm config's own")
    p.add_argument("--seeds", type=int, default=3, help="runs per method")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds first-seed .. first-seed + seeds - 1 (more seeds later without rerunning these)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--parallel", type=int, default=1, help="runs at once (one server each)")
    p.add_argument("--target", type=float, default=TARGET, help="the accuracy of 'steps to target'")
    p.add_argument("--out", default=None, help="the comparison's folder (default: runs/compare/<recipe>)")
    p.add_argument("--replace", action="store_true",
                   help="run again the runs of --out that other settings made (default: refuse, naming them)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run")
    args = p.parse_args(argv)
    algorithms = args.algorithms if args.algorithms is not None else ("" if args.method else DEFAULT_ALGORITHMS)
    methods = parse_methods(algorithms, args.method)
    shared = list(args.overrides) + ([] if args.advantage == "config" else [f"algorithm.advantage={args.advantage}"])
    out = Path(args.out) if args.out else default_out(args.recipe)
    # Validate every combination before starting anything. A top-K divergence needs the engine's
    # top-K log-probs: such a method gets rollout.top_k_logprobs=20 unless the recipe asks for some.
    routes = False  # the servers return routed experts when any method replays them (R3)
    for label, ov in methods.items():
        cfg = to_object(load_config(args.recipe, [*ov, *shared]))
        routes |= cfg.algorithm.router_replay == "r3"
        if cfg.algorithm.divergence in ("topk_tv", "topk_kl") and cfg.rollout.top_k_logprobs <= 0:
            ov.append("rollout.top_k_logprobs=20")
            to_object(load_config(args.recipe, [*ov, *shared]))
    job = to_object(load_config(args.recipe, shared))

    from megatron_rl.rollout.server import EngineManager, ServerConfig
    from megatron_rl.rollout.servers import server_dtype, server_extra_args

    out.mkdir(parents=True, exist_ok=True)
    if job.model.hf_path:
        model, seeded_init = Path(job.model.hf_path), False
    elif job.model.base.sft_steps > 0:
        from megatron_rl.models.base import ensure_base_model

        model, seeded_init = ensure_base_model(job), False
    else:
        from megatron_rl.models.tiny import make_tiny_checkpoint

        model, seeded_init = make_tiny_checkpoint(out / "server_model", **vars(job.model.tiny)), True
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(label, seed) for label in methods for seed in seeds]
    lanes = max(1, args.parallel)
    threads = max(1, (os.cpu_count() or 1) // lanes)
    r = job.rollout
    start = time.perf_counter()

    def run_overrides(label, seed, run_dir, url) -> list[str]:
        return [*methods[label], f"trainer.steps={args.steps}", f"trainer.seed={seed}", f"data.shuffle_seed={seed}",
                *([f"model.tiny.seed={seed}"] if seeded_init else []),
                f"trainer.out_dir={run_dir}", "trainer.resume=false",
                f"rollout.server_urls=[{url}]", "trainer.progress=false", *shared]

    def previous(label, seed) -> tuple[bool, str]:
        """(keep it, why not) for the run folder of (label, seed) if it exists (see `reusable`)."""
        run_dir = out / label / f"seed{seed}"
        if not run_dir.exists():
            return False, "not finished"
        wanted = to_object(load_config(args.recipe, run_overrides(label, seed, run_dir, "http://127.0.0.1:1")))
        if wanted.model.hf_path is None and wanted.model.base.sft_steps > 0:
            wanted.model.hf_path = str(model)  # as `train` resolves it: the cached base model
        return reusable(run_dir, args.steps, as_dict(wanted))

    # Finished runs of other settings in this folder are another comparison's: never replaced unasked.
    found = {job: previous(*job) for job in jobs}
    others = [f"{out / label / f'seed{seed}'} ({why})" for (label, seed), (keep, why) in found.items()
              if not keep and why != "not finished"]
    if others and not args.replace:
        print(f"megatron-rl compare: {out} holds runs made with other settings; give this comparison its own "
              "folder (--out DIR), or run them again with --replace:\n  " + "\n  ".join(others), file=sys.stderr)
        return 2
    # The runs' seeded sampling needs the server's deterministic mode (server_extra_args).
    with EngineManager(ServerConfig(model_path=str(model), dtype=server_dtype(job), max_total_tokens=r.max_total_tokens,
                                    enable_return_routed_experts=routes, extra_args=server_extra_args(job)),
                       lanes, log_dir=out / "server_logs") as mgr:
        free = queue.Queue()
        for url in mgr.urls():
            free.put(url)

        def run(item) -> None:
            label, seed = item
            run_dir = out / label / f"seed{seed}"
            keep, why = found[item]
            if keep:
                print(f"[compare] {label} seed {seed}: done before with these settings, kept ({run_dir})", flush=True)
                return
            if why != "not finished":
                print(f"[compare] {label} seed {seed}: {run_dir} was run with other settings ({why}); "
                      f"running it again (--replace)", flush=True)
            url = free.get()  # a server of its own while it runs (a run pushes its weights to it)
            try:
                _run(label, seed, run_dir, url)
            finally:
                free.put(url)

        def _run(label, seed, run_dir, url) -> None:
            cmd = [sys.executable, "-m", "megatron_rl.cli", "train", args.recipe,
                   *run_overrides(label, seed, run_dir, url)]
            print(f"[compare] {label} seed {seed} -> {run_dir}", flush=True)
            run_dir.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            with open(run_dir / "compare.log", "w") as log:
                rc = subprocess.run(cmd, env=env, stdout=log if len(jobs) > 1 else None,
                                    stderr=subprocess.STDOUT if len(jobs) > 1 else None).returncode
            if rc:
                raise RuntimeError(f"{label} seed {seed} failed (exit {rc}); see {run_dir / 'compare.log'}")

        with ThreadPoolExecutor(lanes) as pool:
            list(pool.map(run, jobs))
    runs = {label: [out / label / f"seed{s}" for s in seeds] for label in methods}
    png = plot_compare(runs, out / "accuracy.png")
    summary = {"recipe": args.recipe, "steps": args.steps, "seeds": list(seeds), "shared_overrides": shared,
               "target": args.target, "wall_s": round(time.perf_counter() - start, 1), "methods": {}}
    for label, dirs in runs.items():
        per_seed = [summarize(d, args.target) for d in dirs]
        finals = [s["final"] for s in per_seed]
        summary["methods"][label] = {
            "overrides": methods[label], "hyperparameter_trials": 1, "per_seed": per_seed,
            "final_mean": sum(finals) / len(finals),
            "best_mean": sum(s["best"] for s in per_seed) / len(per_seed),
            "collapses": sum(s["collapses"] for s in per_seed)}
        hits = [s["steps_to_target"] for s in per_seed]
        print(f"[compare] {label:22s} final train accuracy (mean of the last 5 steps) " + " ".join(f"{x:.2f}" for x in finals)
              + f"  mean {summary['methods'][label]['final_mean']:.2f}  steps to {args.target:.2f}: "
              + " ".join("-" if h is None else str(h) for h in hits), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[compare] plot: {png}")
    return 0
