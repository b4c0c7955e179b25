"""recipes/ppo_gae_tiny_cpu.yaml learns: the recipe's batch for 20 steps, its four models (policy,
critic + GAE, reward model, reference; KL in the rewards), checked step by step.

- the task reward rises (step 0 <= 0.05, last-5 mean >= 0.06);
- the critic's fresh head starts off (explained variance < -0.2 at step 0) and its error falls to
  the returns' own variance (EV > -0.05 from step 2 on: one-token answers, V = V(prompt), and a
  policy equally unsure of every prompt leaves nothing to explain beyond the mean, EV ~ 0); the
  values track the returns (median |values - returns| over the last 5 steps < 0.03);
- the logged KL is ~0 at step 0 and > 1e-3 at step 19.
Exit status 1 when one of these fails.

This was a CI test until the suite's time budget (docs/testing.md): 3-3.5 minutes on the 2-core CI
machine. CI asserts the mechanisms in cheaper tests -- every per-step identity of this run (whitened
reward-model scores, the KL penalty in the rewards, the four models' timings, no KL in the loss),
the critic's checkpoint and exact resume: tests/e2e/test_trainer.py::test_ppo_gae_exact_resume; the
critic learning a target and GAE from its values against float64:
tests/distributed/test_critic_reward.py.

    .venv/bin/python benchmarks/bench_ppo_gae_learning.py [--out DIR] [--steps 20]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    from megatron_rl.run.metrics import read_metrics

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_ppo_gae_")) / "ppo"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "ppo_gae_tiny_cpu",
                           f"trainer.out_dir={out}", f"trainer.steps={args.steps}", "eval.num_prompts=0",
                           "trainer.progress=false", "trainer.plot=false"], cwd=REPO)
    if proc.returncode:
        return proc.returncode
    rows = [r for r in read_metrics(out) if r["step"] >= 0]
    acc = [r["rollout/accuracy"] for r in rows]
    ev = [r["critic/explained_variance"] for r in rows]
    print(f"{len(rows)} steps in {time.monotonic() - start:.0f}s (server start-up included)")
    print("train accuracy per step:", " ".join(f"{a:.3f}" for a in acc))
    print("critic explained variance:", " ".join(f"{e:.3f}" for e in ev))
    print("critic value mse:", " ".join(f"{r['critic/value_mse']:.4f}" for r in rows))
    bias = sorted(abs(r["critic/values_mean"] - r["critic/returns_mean"]) for r in rows[-5:])
    checks = {
        "reward rises (step 0 <= 0.05, last-5 mean >= 0.06)": acc[0] <= 0.05 and sum(acc[-5:]) / 5 >= 0.06,
        "fresh critic head off (EV[0] < -0.2)": ev[0] < -0.2,
        "critic error falls to the returns' variance (EV > -0.05 from step 2)": all(e > -0.05 for e in ev[2:]),
        "values track the returns (median bias, last 5, < 0.03)": bias[2] < 0.03,
        "KL ~0 at step 0, > 1e-3 at the end": abs(rows[0]["kl/rollout_vs_ref"]) < 1e-5
        and abs(rows[-1]["kl/rollout_vs_ref"]) > 1e-3,
    }
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
