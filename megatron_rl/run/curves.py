"""A run's own curves: its metrics.jsonl as one PNG (`curves.png` in the run folder, written when the
run ends with `trainer.plot`, and by `megatron-rl plot RUN_DIR`).

Panels, two rows: train reward / accuracy; eval mean@k / pass@k; policy entropy; the
train-vs-rollout mismatch proper (mean |log π − log μ| of the step's first mini-batch, on the
weights μ came from); |log π − log μ| over all the step's mini-batches (mostly the policy's own
movement within the step); trust-region masked fractions by μ bucket and advantage sign (CPPO's
token test vs prefix budget, DRPO's reversed weights); CPPO's effective threshold; step time by
stage. A supervised run (`train-lm`): loss, greedy eval accuracy, grad norm, tokens/s. Several runs
side by side: tools/plot.py `plot_compare`.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.run.metrics import read_metrics

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
                         "masked_frac/mu_gt_0.9", "masked_frac/adv_pos", "masked_frac/adv_neg",
                         # CPPO: masked by the weighted token test vs by the prefix budget only;
                         # DRPO: the tokens whose weight turned negative (its corrective regime)
                         "cppo_token_masked_frac", "cppo_budget_masked_frac", "reversed_frac"), None),
    ("CPPO threshold (CPPO runs)", ("cppo_threshold/mean", "cppo_delta_b/mean", "cppo_tightened_frac",
                                    "cppo_negative_frac"), None),
    ("step time (s)", ("time/step", "time/generate", "time/train", "time/weight_sync", "time/old_logp", "time/ref_logp"), None),
)
# A supervised run (`train-lm`, the testbed's base stage) logs its own metrics: its own panels.
LM_PANELS = (
    ("loss (masked NLL)", ("loss",), None),
    ("greedy eval accuracy", ("eval_accuracy",), None),
    ("grad norm", ("grad_norm",), None),
    ("tokens/s", ("tokens_per_s",), None),
)
COLUMNS = 4  # panels per row: two rows of legible panels, not one strip


def panels_for(rows: list[dict]) -> tuple:
    """The RL run's panels, or a supervised run's (no rollout metrics, a loss): never empty ones."""
    keys = {k for r in rows for k in r}
    return LM_PANELS if "loss" in keys and not any(k.startswith("rollout/") for k in keys) else PANELS


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
    panels = panels_for(rows)
    rows_n = -(-len(panels) // COLUMNS)
    fig, axes = plt.subplots(rows_n, COLUMNS, figsize=(4.6 * COLUMNS, 3.6 * rows_n), squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (title, keys, prefix) in zip(axes, panels):
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
