"""The supervised warm-up command (`train-lm tiny_lm_cpu`), shortened: a run on CPU whose loss falls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_lm_demo_loss_falls(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "megatron_rl.cli", "train-lm", "tiny_lm_cpu",
         "train.steps=25", "train.log_every=25", f"train.out_dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in history] == list(range(1, 26))
    first, last = history[0]["loss"], history[-1]["loss"]
    assert last < 0.5 * first, (first, last)
    assert "loss" in proc.stdout and "->" in proc.stdout
