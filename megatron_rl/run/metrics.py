"""Run logs: JSONL always, TensorBoard / wandb when asked, a live progress display on rank 0.

`metrics.jsonl` holds one JSON object per step (`step` first). On resume, lines of steps at or
after the resumed step are dropped first, so a resumed run's file reads like an uninterrupted one.
Nothing here needs the network: wandb, when enabled, runs offline unless WANDB_MODE says otherwise.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

from megatron_rl.config.schema import TrainerConfig

HEADLINE = ("rollout/accuracy", "rollout/reward_mean", "loss/pg", "entropy/mean",
            "abs_logp_diff/mean", "masked_frac", "time/step")


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def nonfinite(metrics: dict) -> list[str]:
    return sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))


class MetricsLogger:
    def __init__(self, out_dir: Path, cfg: TrainerConfig, enabled: bool, start_step: int,
                 run_name: str, config_dict: Optional[dict] = None):
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.tb = self.wandb = None
        self.progress = None
        if not enabled:
            return
        if self.path.exists():
            # A fresh start (step 0) also drops the initial-eval row (-1) of an earlier run.
            kept = [m for m in read_metrics(self.path) if 0 < start_step and m.get("step", 0) < start_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tb"))
        if cfg.wandb:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            self.wandb = wandb.init(project=cfg.wandb_project, name=run_name, dir=str(out_dir),
                                    config=config_dict, id=wandb_run_id(out_dir, fresh=start_step == 0),
                                    resume="allow")
        self.total, self.clock = cfg.steps, _Clock(cfg.steps, start_step)
        if cfg.progress:
            self.progress = _Progress(cfg.steps, start_step)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        line = format_line(step, metrics, self.total, self.clock.eta(step)) if step >= 0 else format_line(step, metrics)
        if self.progress is not None:
            self.progress.update(step, metrics, line)
        else:
            print(line, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.stop()
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def wandb_run_id(out_dir: Path, fresh: bool) -> str:
    """The wandb run of this run folder: made when the run starts (step 0) and kept in
    out_dir/wandb_run_id, so that every resume logs into the same wandb run."""
    import uuid

    path = out_dir / "wandb_run_id"
    if fresh or not path.is_file():
        path.write_text(uuid.uuid4().hex[:16])
    return path.read_text().strip()


def format_line(step: int, m: dict, total: Optional[int] = None, eta_s: Optional[float] = None) -> str:
    """One step's line: `step  12/60  accuracy 0.41 ... eta 2m10s` (total and eta when known)."""
    parts = [f"step {step:4d}" + (f"/{total}" if total else "")]
    for k in HEADLINE + tuple(k for k in m if k.startswith("eval/")):
        if k in m:
            parts.append(f"{k.split('/')[-1] if k.startswith(('rollout/', 'time/')) else k} {m[k]:.3f}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    return "  ".join(parts)


def format_duration(s: float) -> str:
    s = max(0, int(round(s)))
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


class _Clock:
    """Remaining time from this launch's own pace (a resumed run's earlier steps do not count)."""

    def __init__(self, total: int, start: int):
        import time

        self.total, self.start, self.t0, self.now = total, start, time.monotonic(), time.monotonic

    def eta(self, step: int) -> Optional[float]:
        done = step + 1 - self.start
        if done <= 0:
            return None
        return (self.now() - self.t0) / done * max(0, self.total - step - 1)


class _Progress:
    """A rich progress bar with the headline metrics (a TTY), or a plain line per step."""

    def __init__(self, total: int, start: int):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.console = Console(file=sys.stdout)
        self.live = self.console.is_terminal
        self.bar = None
        if self.live:
            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.description}"),
                                console=self.console)
            self.task = self.bar.add_task("", total=total, completed=start)
            self.bar.start()

    def update(self, step: int, m: dict, line: str) -> None:
        if self.bar is None:
            self.console.print(line, highlight=False, soft_wrap=True)
            return
        self.bar.update(self.task, completed=step + 1,
                        description=f"acc {m.get('rollout/accuracy', float('nan')):.2f}  "
                                    f"reward {m.get('rollout/reward_mean', float('nan')):.2f}")
        if any(k.startswith("eval/") for k in m) or step % 10 == 0:
            self.console.print(line, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
