"""`megatron-rl plot RUN_DIR`: a run's metrics.jsonl as PNG curves (one figure, several panels).

Panels: rollout reward / accuracy and eval mean@k / pass@k; policy entropy; train-vs-rollout
mismatch (mean |log π − log μ|); trust-region masked fractions by μ bucket and advantage sign;
step time by stage. `plot_compare` overlays several runs (e.g. algorithms x seeds) by label.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

from megatron_rl.trainer.metrics import read_metrics

PANELS = (
    ("reward and accuracy", ("rollout/accuracy", "rollout/reward_mean"), "eval/"),
    ("entropy", ("entropy/mean",), None),
    ("mismatch |log pi - log mu|", ("mismatch/train_vs_rollout_abs_logp", "abs_logp_diff/mean",
                                     "mismatch/old_vs_rollout_abs_logp"), None),
    ("masked fraction", ("masked_frac", "masked_frac/mu_lt_0.1", "masked_frac/mu_0.1_0.9",
                         "masked_frac/mu_gt_0.9", "masked_frac/adv_pos", "masked_frac/adv_neg"), None),
    ("step time (s)", ("time/step", "time/generate", "time/train", "time/weight_sync", "time/old_logp", "time/ref_logp"), None),
)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r and r["step"] >= 0]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = Path(out) if out else run_dir / "curves.png"
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (title, keys, prefix) in zip(axes, PANELS):
        keys = list(keys) + sorted({k for r in rows for k in r if prefix and k.startswith(prefix)})
        for k in keys:
            x, y = _series(rows, k)
            if k.startswith("eval/"):
                # Eval after step s measures the weights of step s+1; the initial policy is row -1.
                init = [r[k] for r in rows if r["step"] < 0 and k in r][:1]
                x, y = [0] * len(init) + [s + 1 for s in x], init + y
            if x:
                ax.plot(x, y, marker="o" if k.startswith("eval/") else None, ms=3, lw=1.2, label=k)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle(run_dir.name, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_compare(runs: dict[str, Sequence[str | Path]], out: str | Path,
                 key: str = "rollout/accuracy") -> Path:
    """`runs`: label -> run dirs (seeds). Mean and min-max band of `key` per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, dirs in runs.items():
        by_step: dict[int, list[float]] = defaultdict(list)
        for d in dirs:
            for s, v in zip(*_series(read_metrics(d), key)):
                by_step[s].append(v)
        steps = sorted(by_step)
        mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
        ax.plot(steps, mean, label=f"{label} (n={len(dirs)})")
        ax.fill_between(steps, [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps], alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)
