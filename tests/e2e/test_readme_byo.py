"""README "Bring your own data, reward and model": the block between `<!-- byo:begin -->` and
`<!-- byo:end -->` runs verbatim (bash -e) in a fresh folder whose `.venv` is this checkout's.

What it must show, checked against independent numbers:
- training read the user's JSONL and scored with the user's reward file (the saved config says so;
  metrics rise over the run's own step −1 evaluation of the initial model);
- the embedded default's batch and hyper-parameters learn (tiny_cpu, 20 steps, the demo's task from
  files): from a random policy's accuracy (≤ 0.05) to ≥ 0.15 over the last five steps (this was
  test_trainer's short-demo run; the 60-step demo bar is benchmarks/bench_demo_slurm.py);
- the export is a Hugging Face folder transformers loads;
- eval of the export is well above the initial model's eval on the same prompts;
- the commands start quietly (no upstream "not installed" notices).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def readme_block() -> str:
    text = (REPO / "README.md").read_text()
    m = re.search(r"<!-- byo:begin -->\n```bash\n(.*?)```\n<!-- byo:end -->", text, re.S)
    assert m, "README.md has no byo:begin / byo:end bash block"
    return m.group(1)


def test_readme_bring_your_own_runs_verbatim(tmp_path):
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    env = {k: v for k, v in os.environ.items() if k not in ("MRL_VERBOSE", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO)  # this checkout's package, whatever the venv's editable install points at
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", readme_block()], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "not installed" not in out.stderr, out.stderr[-3000:]

    run = tmp_path / "runs" / "byo"
    config = (run / "config.yaml").read_text()
    assert "byo/my_reward.py:score" in config and "byo/train.jsonl" in config
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    initial = next(r for r in rows if r["step"] == -1)["eval/mean@4"]
    accuracy = [r["rollout/accuracy"] for r in rows if "rollout/accuracy" in r]
    assert len(accuracy) == 20 and max(accuracy[-3:]) > accuracy[0] + 0.05, accuracy
    assert accuracy[0] <= 0.05 and sum(accuracy[-5:]) / 5 >= 0.15, accuracy  # a random policy over 128 tokens learns

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert model.config.vocab_size == 128
    report = json.loads((run / "hf_eval.json").read_text())
    final = report["metrics"]["eval/mean@4"]
    assert report["num_prompts"] == 64 and final > initial + 0.05, (initial, report)
