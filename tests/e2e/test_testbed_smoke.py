"""The testbed pipeline end to end, small (CI smoke, ~2-3 min): the supervised base stage (built,
then reused from its cache), `megatron-rl compare --recipe testbed_cpu` with two methods at once (`--parallel 2`:
a bfloat16 SGLang server each) -- DPPO binary-TV, and DRPO at δ 0.15 with FP8-rounded rollouts
(rollout.quantization=fp8) --, the token log, and the report (benchmarks/testbed_report.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_rl.config.load import load_config, to_object
from megatron_rl.models.base import ensure_base_model
from megatron_rl.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
# A short base stage (no early stop), a small batch that still has 8 mini-batches, a small eval.
SMALL = ["model.base.sft_steps=30", "model.base.target_accuracy=1.0", "rollout.prompts_per_step=8",
         "rollout.n_samples=4", "eval.num_prompts=8", "eval.k=2", "eval.every=0", "learner.micro_batch_size=8"]


@pytest.mark.slow
def test_testbed_compare_smoke(tmp_path):
    cache = tmp_path / "bases"
    out = tmp_path / "compare"
    overrides = [*SMALL, f"model.base.cache_dir={cache}", "trainer.token_log_every=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "compare", "--recipe", "testbed_cpu", "--algorithms", "",
         "--method", "dppo_tv=dppo_binary_tv",
         "--method", "drpo_fp8=drpo algorithm.loss_kwargs.delta=0.15 rollout.quantization=fp8",
         "--seeds", "1", "--first-seed", "2", "--steps", "2", "--parallel", "2", "--out", str(out), *overrides],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    # the base: built once, cached by its config, reused (not rebuilt) by a later call
    job = to_object(load_config("testbed_cpu", overrides))
    (base,) = [d for d in cache.iterdir() if d.is_dir()]
    record = json.loads((base / "base.json").read_text())
    assert record["steps"] == 30 and record["spec"]["task"]["op"] == "add_steps"
    stamp = (base / "base.json").stat().st_mtime_ns
    assert ensure_base_model(job) == base / "hf" and (base / "base.json").stat().st_mtime_ns == stamp

    # the two runs ran at the same time, each against its own server (weights are per server)
    assert len(list((out / "server_logs").glob("server*.log"))) == 2
    urls = {yaml.safe_load((out / m / "seed2" / "config.yaml").read_text())["rollout"]["server_urls"][0]
            for m in ("dppo_tv", "drpo_fp8")}
    assert len(urls) == 2, urls
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["methods"]) == ["dppo_tv", "drpo_fp8"] and summary["seeds"] == [2]
    assert "algorithm.advantage=dr_grpo" in summary["shared_overrides"]
    mismatch = {}
    for label, m in summary["methods"].items():
        assert m["hyperparameter_trials"] == 1 and len(m["per_seed"]) == 1
        run_dir = out / label / "seed2"
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        # everything but the policy loss (and here the FP8 rollouts) is shared; Dr.GRPO advantages
        assert cfg["model"]["hf_path"] == str(base / "hf") and cfg["algorithm"]["advantage"] == "dr_grpo"
        assert cfg["rollout"]["dtype"] == "bfloat16" and cfg["algorithm"]["mini_batches"] == 8
        assert cfg["algorithm"]["policy_loss"] == ("dppo" if label == "dppo_tv" else "drpo")
        assert cfg["rollout"]["quantization"] == ("none" if label == "dppo_tv" else "fp8")
        assert cfg["algorithm"]["agg_mode"] == "token-mean"  # the testbed's, not drpo.yaml's
        rows = [r for r in read_metrics(run_dir) if r["step"] >= 0]
        assert [r["step"] for r in rows] == [0, 1]
        mismatch[label] = rows[0]["mismatch/train_vs_rollout_abs_logp"]
        if label == "drpo_fp8":  # DRPO's own statistics, per split like the masked fraction
            assert any(k.endswith("reversed_frac") for k in rows[0]) and any(k.endswith("drpo_w/mean") for k in rows[0])
        # bfloat16 engine vs float32 learner: a real mismatch (a float32 server gives ~1e-6)
        assert all(r["mismatch/train_vs_rollout_abs_logp"] > 5e-4 for r in rows), rows
        # the token log: 8 mini-batches, per-token log μ equal to the rollout's, log π near it
        log = torch.load(run_dir / "tokens" / "step0.dp0.pt", weights_only=True)
        assert len(log["mini_batches"]) == 8
        first = log["mini_batches"][0][0]
        n = int(first["loss_mask"].sum())
        assert first["logp"].shape == first["rollout_logp"].shape == first["advantages"].shape == (n,)
        gap = (first["logp"] - first["rollout_logp"]).abs().mean().item()
        assert 1e-4 < gap < 0.5, gap  # the first mini-batch: no update yet, only the bf16 mismatch

    # Step 0, first mini-batch (the same base weights and prompts): FP8-rounded servers add the
    # weights' quantization error to the bfloat16 engine's (measured 0.0065 vs 0.0048 nats here).
    assert mismatch["drpo_fp8"] > 1.15 * mismatch["dppo_tv"], mismatch

    report = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "benchmarks/testbed_report.py", str(out), "--figures",
                           str(tmp_path / "figures"), "--out", str(report)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    text = report.read_text()
    assert "### Results" in text and "| dppo_tv |" in text and "| drpo_fp8 |" in text
    assert "μ < 0.1" in text or "μ > 0.9" in text  # the token table has rows
    assert (tmp_path / "figures" / "testbed_compare_accuracy.png").stat().st_size > 10_000
