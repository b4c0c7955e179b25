"""Learning under staleness: does asynchronous training still reach the demo's 80 % target?

Runs `megatron-rl compare` on the tiny task (recipe tiny_cpu, `max(a,b)` of two digits from
random weights) once per maximum staleness k (`trainer.max_staleness`), each with DPPO binary-TV
and GRPO clip-higher over the same seeds, plus the DPPO paper's anchor ablation at the largest k:

    k in --ks:   compare --algorithms dppo_binary_tv,grpo_clip_higher  trainer.max_staleness=k
    ablation:    compare --algorithms dppo_binary_tv  trainer.max_staleness=K
                         +algorithm.loss_kwargs.anchor=old algorithm.recompute_old_logp=true

In the ablation the trust region is centred on π_old, the learner's weights at the start of the
step (recomputed before training), instead of on μ, the weights that sampled: under staleness the
mask then no longer bounds how far π moves from the sampling policy. Its μ-anchored counterpart is
the k = K DPPO run of the main grid (the default anchor). Every compare shares one SGLang server
among its runs; the runs are generated with drain at weight pushes (partial rollouts off), so a
step's tokens come from exactly one weight version, at most k steps old.

The report reads every run's metrics.jsonl and prints, per (algorithm, k): the step at which the
train accuracy (`rollout/accuracy`, the accuracy of the sampled batch, i.e. of weights up to k
steps old) first reaches 80 % per seed and their median, and the median weight version that
sampled that batch (the step minus its staleness: the updates the sampling policy had had); the
final accuracy (mean of the last 5 steps); the best eval mean@4 (held-out prompts, current weights); collapse events; wall time per
run; and over the steps, the mean staleness (`async/staleness_mean`) and, on stale tokens only,
the trust region's masked fraction (`stale/masked_frac`) and |log π − log μ|
(`stale/abs_logp_diff/mean`). A collapse event is a stretch of >= 5 consecutive steps whose
accuracy lies more than 0.3 below the run's running best, or a run that stopped early (a
non-finite metric stops the trainer, `TrainingError`). The plot (accuracy curves, mean and
min-max band over seeds) goes to docs/figures/async_learning.png.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async_learning.py --out runs/async_learning  # 21 runs
    .venv/bin/python benchmarks/bench_async_learning.py --out runs/async_learning --report-only

OMP_NUM_THREADS=1: on a shared 2-core machine every process's default of 2 intra-op threads
oversubscribes the cores (trainer, server, neighbours); it slowed steps ~20x (60 s instead of 3 s).
A compare whose summary.json exists is not run again (delete it, or --force, to redo it), so an
interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALGORITHMS = ("dppo_binary_tv", "grpo_clip_higher")
LABELS = {"dppo_binary_tv": "DPPO binary-TV", "grpo_clip_higher": "GRPO clip-higher"}
TARGET = 0.8
COLLAPSE_DROP, COLLAPSE_STEPS = 0.3, 5
ANCHOR_OLD = ("+algorithm.loss_kwargs.anchor=old", "algorithm.recompute_old_logp=true")


def run_compare(out: Path, algorithms: list[str], overrides: list[str], args) -> dict:
    """One `megatron-rl compare`; returns {"rc", "wall": {run_dir: seconds}}. Each run's wall time
    is the time from compare announcing it to announcing the next one (or its summary): process
    start-up, model build, every step and the final checkpoint, not the shared server's start."""
    cmd = [sys.executable, "-m", "megatron_rl.cli", "compare", "--recipe", "tiny_cpu",
           "--algorithms", ",".join(algorithms), "--seeds", str(args.seeds), "--first-seed", str(args.first_seed),
           "--steps", str(args.steps), "--out", str(out),
           "--advantage", "config",  # each algorithm config's own estimator, as when docs/benchmarks.md was made
           *overrides]
    print("[bench] " + " ".join(cmd[2:]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float] = {}
    current, t0, start = None, None, time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
    for line in proc.stdout:
        print(line, end="", flush=True)
        now = time.monotonic()
        if line.startswith("[compare]") and (" -> " in line or "final train accuracy" in line or "plot:" in line):
            if current is not None:
                wall[current] = now - t0
                current = None
            if " -> " in line:
                current, t0 = line.rsplit(" -> ", 1)[1].strip(), now
    rc = proc.wait()
    if current is not None:  # the run that was going when compare stopped
        wall[current] = time.monotonic() - t0
    info = {"rc": rc, "wall": wall, "total_s": time.monotonic() - start, "overrides": overrides}
    (out / "bench_walltimes.json").write_text(json.dumps(info, indent=1))
    if rc != 0:
        print(f"[bench] compare into {out} exited {rc}; its finished runs are still reported", flush=True)
    return info


# ----------------------------------------------------------------------------- per-run summary

def steps_to(acc: list[tuple[int, float]], target: float):
    return next((s for s, a in acc if a >= target), None)


def collapse_events(acc: list[float]) -> int:
    """Stretches of >= COLLAPSE_STEPS consecutive steps with accuracy < running best − COLLAPSE_DROP."""
    events, best, below = 0, -math.inf, 0
    for a in acc:
        below = below + 1 if a < best - COLLAPSE_DROP else 0
        if below == COLLAPSE_STEPS:
            events += 1
        best = max(best, a)
    return events


def sustained_drop(acc: list[float], span: int = COLLAPSE_STEPS) -> float:
    """The largest drop below the running best held for `span` consecutive steps (the margin to
    the collapse threshold): max over i of best(acc[:i+1]) − max(acc[i:i+span])."""
    drop, best = 0.0, -math.inf
    for i in range(len(acc) - span + 1):
        best = max(best, acc[i])
        drop = max(drop, best - max(acc[i:i + span]))
    return drop


def mean_of(rows: list[dict], key: str):
    vals = [r[key] for r in rows if key in r and isinstance(r[key], (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else None


def token_mean(rows: list[dict], key: str, part: str):
    """Mean of `part/key` over the steps, weighted by each step's `part/tokens` (steps without
    such tokens log 0 and weigh nothing)."""
    num = den = 0.0
    for r in rows:
        n, v = r.get(f"{part}/tokens", 0.0), r.get(f"{part}/{key}")
        if n > 0 and isinstance(v, (int, float)) and math.isfinite(v):
            num, den = num + n * v, den + n
    return num / den if den else None


def summarize_run(run: Path, steps: int, wall: float | None) -> dict:
    from megatron_rl.run.metrics import read_metrics

    rows = [r for r in read_metrics(run) if r["step"] >= 0] if (run / "metrics.jsonl").exists() else []
    acc = [(r["step"], r["rollout/accuracy"]) for r in rows if "rollout/accuracy" in r]
    nonfinite = sorted({k for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)})
    stopped = len(rows) < steps
    evals = [v for r in rows for k, v in r.items() if k.startswith("eval/mean@")]
    cfg = (run / "config.yaml").read_text() if (run / "config.yaml").exists() else ""
    return {
        "run": str(run), "steps_done": len(rows), "stopped_early": stopped, "nonfinite": nonfinite,
        "steps_to_target": steps_to(acc, TARGET),
        # The weight version that sampled that batch: the step minus its staleness (drain: exact).
        "version_at_target": next((r["step"] - round(r.get("async/staleness_mean", 0.0)) for r in rows
                                   if r.get("rollout/accuracy", 0.0) >= TARGET), None),
        "final_acc": (sum(a for _, a in acc[-5:]) / len(acc[-5:])) if acc else None,
        "best_eval": max(evals) if evals else None,
        "collapses": collapse_events([a for _, a in acc]) + int(stopped or bool(nonfinite)),
        "wall_s": wall if wall is not None else sum(r.get("time/step", 0.0) for r in rows) or None,
        "staleness_mean": mean_of(rows, "async/staleness_mean"),
        "stale_masked_frac": token_mean(rows, "masked_frac", "stale"),
        "stale_abs_logp": token_mean(rows, "abs_logp_diff/mean", "stale"),
        "stale_abs_old_logp": token_mean(rows, "abs_old_logp_diff/mean", "stale"),
        # Synchronous runs (k = 0) log no split: every token is fresh.
        "fresh_masked_frac": (token_mean(rows, "masked_frac", "fresh") if any("fresh/tokens" in r for r in rows)
                              else mean_of(rows, "masked_frac")),
        "masked_frac": mean_of(rows, "masked_frac"),
        # While the task is being learnt (steps 2 .. steps/2 − 1; k = 2 has stale tokens from step 2):
        # the share of positive-advantage tokens, the learning signal, whose gradient was stopped.
        "masked_adv_pos_learning": mean_of([r for r in rows if 2 <= r["step"] < steps // 2], "masked_frac/adv_pos"),
        "max_drop_5": sustained_drop([a for _, a in acc]) if len(acc) >= COLLAPSE_STEPS else None,
        "old_vs_rollout": mean_of(rows, "mismatch/old_vs_rollout_abs_logp"),
        # What the loss really ran with, from the run's saved config (the override must reach it).
        "anchor_old": "anchor: old" in cfg, "recompute_old_logp": "recompute_old_logp: true" in cfg,
        "max_staleness": next((int(line.split(":")[1]) for line in cfg.splitlines()
                               if line.strip().startswith("max_staleness:")), None),
        "acc_curve": acc,
    }


def collect(out: Path, args) -> list[dict]:
    """One entry per (algorithm, k, anchor) group, with its runs' summaries."""
    groups = []
    specs = [(a, k, "mu", out / f"k{k}") for k in args.ks for a in ALGORITHMS]
    if args.ablation_k is not None:
        specs.append(("dppo_binary_tv", args.ablation_k, "pi_old", out / f"k{args.ablation_k}_anchor_old"))
    for a, k, anchor, cdir in specs:
        wall_file = cdir / "bench_walltimes.json"
        wall = json.loads(wall_file.read_text())["wall"] if wall_file.exists() else {}
        runs = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            run = cdir / a / f"seed{seed}"
            if run.exists():
                runs.append(summarize_run(run, args.steps, wall.get(str(run))))
        if runs:
            groups.append({"algorithm": a, "k": k, "anchor": anchor, "runs": runs})
    return groups


# ----------------------------------------------------------------------------- report

def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _med_reached(xs) -> str:
    """Median over seeds, a run that never reached the target counting as +inf."""
    med = statistics.median([math.inf if x is None else x for x in xs])
    return "not reached" if math.isinf(med) else f"{med:g}"


def table(groups: list[dict]) -> str:
    head = ("| algorithm | k | anchor | steps to 80 % (per seed) | median | sampled by version (median) | final acc (min–max) | best eval mean@4 "
            "| collapses | wall / run (s) | staleness | masked (stale / fresh) | abs(log π − log μ) stale |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for g in groups:
        rs = g["runs"]
        reach = [r["steps_to_target"] for r in rs]
        finals = [r["final_acc"] for r in rs if r["final_acc"] is not None]
        lines.append(
            f"| {LABELS[g['algorithm']]} | {g['k']} | {'π_old' if g['anchor'] == 'pi_old' else 'μ'} "
            f"| {', '.join('not reached' if s is None else str(s) for s in reach)} "
            f"| {_med_reached(reach)} "
            f"| {_med_reached([r['version_at_target'] for r in rs])} "
            f"| {_f(_mean(finals))} ({_f(min(finals) if finals else None)}–{_f(max(finals) if finals else None)}) "
            f"| {_f(_mean([r['best_eval'] for r in rs]))} "
            f"| {sum(r['collapses'] for r in rs)} / {len(rs)} runs "
            f"| {_f(_mean([r['wall_s'] for r in rs]), '{:.0f}')} "
            f"| {_f(_mean([r['staleness_mean'] for r in rs]))} "
            f"| {_f(_mean([r['stale_masked_frac'] for r in rs]), '{:.3f}')} / "
            f"{_f(_mean([r['fresh_masked_frac'] for r in rs]), '{:.3f}')} "
            f"| {_f(_mean([r['stale_abs_logp'] for r in rs]), '{:.3f}')} |")
    return "\n".join(lines)


def table_signal(groups: list[dict], steps: int) -> str:
    """Per seed: the masked share of A > 0 tokens while learning, and the collapse margin."""
    lines = [f"| algorithm | k | anchor | masked frac of A>0 tokens, steps 2–{steps // 2 - 1} (per seed) "
             "| largest 5-step drop below running best (per seed) |", "|---|---|---|---|---|"]
    for g in groups:
        rs = g["runs"]
        lines.append(f"| {LABELS[g['algorithm']]} | {g['k']} | {'π_old' if g['anchor'] == 'pi_old' else 'μ'} "
                     f"| {', '.join(_f(r['masked_adv_pos_learning'], '{:.3f}') for r in rs)} "
                     f"| {', '.join(_f(r['max_drop_5']) for r in rs)} |")
    return "\n".join(lines)


def check_overrides(groups: list[dict]) -> list[str]:
    """Each run's saved config must say what its group claims (staleness, anchor, π_old recompute)."""
    problems = []
    for g in groups:
        for r in g["runs"]:
            want_old = g["anchor"] == "pi_old"
            if r["max_staleness"] != g["k"]:
                problems.append(f"{r['run']}: config max_staleness={r['max_staleness']}, expected {g['k']}")
            if r["anchor_old"] != want_old or r["recompute_old_logp"] != want_old:
                problems.append(f"{r['run']}: config anchor_old={r['anchor_old']} "
                                f"recompute_old_logp={r['recompute_old_logp']}, expected {want_old}")
            if want_old and r["steps_done"] and r["old_vs_rollout"] is None:
                problems.append(f"{r['run']}: no mismatch/old_vs_rollout_abs_logp: π_old was not recomputed")
    return problems


def plot(groups: list[dict], png: Path) -> Path:
    """Accuracy curves, one panel per algorithm, one line per (k, anchor): mean and min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [a for a in ALGORITHMS if any(g["algorithm"] == a for g in groups)]
    fig, axes = plt.subplots(1, len(algos), figsize=(6 * len(algos), 4), sharey=True, squeeze=False)
    colors = {0: "tab:blue", 1: "tab:orange", 2: "tab:green", 3: "tab:purple", 4: "tab:brown"}
    for ax, a in zip(axes[0], algos):
        for g in (g for g in groups if g["algorithm"] == a):
            by_step: dict[int, list[float]] = {}
            for r in g["runs"]:
                for s, v in r["acc_curve"]:
                    by_step.setdefault(s, []).append(v)
            steps = sorted(by_step)
            mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
            old = g["anchor"] == "pi_old"
            color = "tab:red" if old else colors.get(g["k"], None)
            label = f"k={g['k']}" + (", anchor π_old (recomputed)" if old else ", anchor μ") + f" (n={len(g['runs'])})"
            ax.plot(steps, mean, color=color, ls="--" if old else "-", lw=1.4, label=label)
            ax.fill_between(steps, [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps],
                            color=color, alpha=0.15)
        ax.axhline(TARGET, color="grey", lw=0.8, ls=":")
        ax.set_title(f"{LABELS[a]}: train accuracy by max staleness k", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("rollout/accuracy")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/async_learning")
    p.add_argument("--ks", default="0,1,2", help="comma-separated trainer.max_staleness values")
    p.add_argument("--ablation-k", type=int, default=None,
                   help="k of the π_old-anchor ablation (default: the largest of --ks; -1: none)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--figure", default=str(ROOT / "docs/figures/async_learning.png"))
    p.add_argument("--report-only", action="store_true", help="only read the runs under --out")
    p.add_argument("--force", action="store_true", help="rerun compares that already finished")
    args = p.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",") if k != ""]
    if args.ablation_k is None:
        args.ablation_k = max(args.ks)
    elif args.ablation_k < 0:
        args.ablation_k = None
    out = Path(args.out)

    if not args.report_only:
        jobs = [(out / f"k{k}", list(ALGORITHMS), [f"trainer.max_staleness={k}"]) for k in args.ks]
        if args.ablation_k is not None:
            # First: its overrides are the likeliest to go wrong, and the report checks them.
            jobs.insert(0, (out / f"k{args.ablation_k}_anchor_old", ["dppo_binary_tv"],
                            [f"trainer.max_staleness={args.ablation_k}", *ANCHOR_OLD]))
        for cdir, algos, overrides in jobs:
            if (cdir / "summary.json").exists() and not args.force:
                print(f"[bench] {cdir} done earlier (summary.json); not run again", flush=True)
                continue
            run_compare(cdir, algos, overrides, args)

    groups = collect(out, args)
    if not groups:
        print(f"[bench] no runs under {out}", file=sys.stderr)
        return 1
    problems = check_overrides(groups)
    for msg in problems:
        print(f"[bench] CONFIG MISMATCH {msg}", flush=True)
    print(f"\nsteps: {args.steps}, seeds {args.first_seed}..{args.first_seed + args.seeds - 1}; step indices from 0; "
          f"'steps to 80 %' = first step whose rollout/accuracy >= {TARGET}; staleness and the stale-token "
          "columns are means over steps (stale/ and fresh/ weighted by their tokens)\n")
    print(table(groups))
    print()
    print(table_signal(groups, args.steps))
    for g in groups:
        for r in g["runs"]:
            if r["stopped_early"] or r["nonfinite"]:
                print(f"[bench] {r['run']}: {r['steps_done']} of {args.steps} steps"
                      + (f"; non-finite {', '.join(r['nonfinite'])}" if r["nonfinite"] else ""))
    (out / "report.json").write_text(json.dumps(groups, indent=1))
    print(f"\n[bench] plot: {plot(groups, Path(args.figure))}; per-run numbers: {out / 'report.json'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
