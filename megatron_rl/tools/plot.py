"""Plots over several runs: `plot_compare` overlays runs (e.g. algorithms x seeds) by label, mean and
min-max band. One run's own curves (`megatron-rl plot RUN_DIR`, `curves.png`): run/curves.py.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

from megatron_rl.run.curves import plot_run  # noqa: F401 (megatron-rl plot, the old import path)
from megatron_rl.run.curves import _series
from megatron_rl.run.metrics import read_metrics


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
