"""`megatron-rl plot RUN_DIR`: a run's metrics.jsonl as PNG curves (one figure, several panels).

Panels, two rows: train reward / accuracy; eval mean@k / pass@k; policy entropy; the
train-vs-rollout mismatch proper (mean |log π − log μ| of the step's first mini-batch, on the
weights μ came from); |log π − log μ| over all the step's mini-batches (mostly the policy's own
movement within the step); trust-region masked fractions by μ bucket and advantage sign; step time
by stage. `plot_compare` overlays several runs (e.g. algorithms x seeds) by label.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

from megatron_rl.trainer.metrics import read_metrics

PANELS = (
    ("train reward and accuracy", ("rollout/accuracy", "rollout/reward_mean"), None),
    ("eval", (), "eval/"),
    ("entropy", ("entropy/mean",), None),
    # The engine-vs-learner mismatch proper: the step's first mini-batch, on the weights μ came from.
    ("train-vs-rollout mismatch |log pi - log mu|", ("mismatch/train_vs_rollout_abs_logp",
                                                      "mismatch/old_vs_rollout_abs_logp"), None),
    # Over all mini-batches: mostly the policy moving away from μ within the step, plus the mismatch.
    ("|log pi - log mu| over the step's mini-batches", ("abs_logp_diff/mean",), None),
    ("masked fraction", ("masked_frac", "masked_frac/mu_lt_0.1", "masked_frac/mu_0.1_0.9",
                         "masked_frac/mu_gt_0.9", "masked_frac/adv_pos", "masked_frac/adv_neg"), None),
    ("step time (s)", ("time/step", "time/generate", "time/train", "time/weight_sync", "time/old_logp", "time/ref_logp"), None),
)
COLUMNS = 4  # panels per row: two rows of legible panels, not one strip


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r and r["step"] >= 0]
    return [p[0] for p in pts], [p[1] for p in pts]


# eval/ keys that are not scores
EVAL_BOOKKEEPING = {"eval/step", "eval/weight_version", "eval/failed"}


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = Path(out) if out else run_dir / "curves.png"
    rows_n = -(-len(PANELS) // COLUMNS)
    fig, axes = plt.subplots(rows_n, COLUMNS, figsize=(4.6 * COLUMNS, 3.6 * rows_n), squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(PANELS):]:
        ax.set_visible(False)
    for ax, (title, keys, prefix) in zip(axes, PANELS):
        keys = list(keys) + sorted({k for r in rows for k in r if prefix and k.startswith(prefix)
                                    and k not in EVAL_BOOKKEEPING})
        for k in keys:
            x, y = _series(rows, k)
            if k.startswith("eval/"):
                # Eval after step s measures the weights of step s+1; the initial policy is row -1;
                # an evaluation beside training (eval.servers) names its weights: eval/step.
                pts = sorted((r.get("eval/step", r["step"] + 1), r[k]) for r in rows if k in r)
                x, y = [p[0] for p in pts], [p[1] for p in pts]
            if x:
                ax.plot(x, y, marker="o" if k.startswith("eval/") else None, ms=3, lw=1.2, label=k)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
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
