"""The embedded default (`train tiny_cpu`, unchanged) as an sbatch job: does it meet the demo's bar?

DP=2 over two srun tasks on one node of a running Slurm cluster, SGLang started by rank 0 beside
them (local placement). Reports the train accuracy per step, the job's wall time, and whether the
demo's bar holds: accuracy <= 0.2 at step 0, a mean >= 0.8 over the last 5 of the 60 steps, curves
plotted. Exit status 1 when it does not.

This was a CI test until the suite's time budget (docs/testing.md): 199 s of the serial suite on the
2-core machine (2026-11-26), and its parts are asserted in CI by cheaper tests --
- the same job shape (sbatch, DP=2 over two srun tasks, rank 0 starting SGLang, the RL trainer, curves
  plotted): tests/slurm/test_sbatch.py::test_usr1_checkpoints_requeues_resumes_rl_trainer;
- the embedded default's batch and hyper-parameters learning: tests/e2e/test_readme_byo.py (20 steps of tiny_cpu from files).

    slurm/local_cluster.sh start && export SLURM_CONF=/tmp/megatron-rl-slurm/slurm.conf
    .venv/bin/python benchmarks/bench_demo_slurm.py [--out DIR] [--timeout 1800]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "slurm" / "megatron_rl.sbatch"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}


def job_state(jobid: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", jobid], capture_output=True, text=True,
                         check=True).stdout
    return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the job log and run (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_demo_slurm_"))
    out.mkdir(parents=True, exist_ok=True)
    run = out / "run"
    env = {**os.environ, "PYTHON": sys.executable, "GPUS_PER_NODE": "2", "RUN_DIR": str(run)}
    start = time.monotonic()
    jobid = subprocess.run(["sbatch", "--parsable", f"--output={out}/job-%j.out", "--nodes=1", "--ntasks=2",
                            str(SBATCH), "tiny_cpu"], cwd=REPO, env=env, capture_output=True, text=True,
                           check=True).stdout.strip().split(";")[0]
    deadline = start + args.timeout
    while (info := job_state(jobid))["JobState"] not in FINAL:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", jobid])
            print(f"job {jobid} not finished after {args.timeout:.0f}s; log: {out}/job-{jobid}.out")
            return 1
        time.sleep(2)
    wall = time.monotonic() - start
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()] if (run / "metrics.jsonl").exists() else []
    acc = [r["rollout/accuracy"] for r in rows if "rollout/reward_mean" in r]
    print(f"job {jobid}: {info['JobState']} exit {info['ExitCode']} in {wall:.0f}s (submit to end)")
    print("train accuracy per step:", " ".join(f"{a:.2f}" for a in acc))
    last5 = sum(acc[-5:]) / 5 if len(acc) >= 5 else float("nan")
    curves = run / "curves.png"
    ok = (info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and len(acc) == 60 and acc[0] <= 0.2
          and last5 >= 0.8 and curves.exists() and curves.stat().st_size > 10_000)
    print(f"demo bar (step 0 <= 0.2, last-5 mean >= 0.8, 60 steps, curves.png): "
          f"{'met' if ok else 'NOT met'} (step 0 {acc[0] if acc else float('nan'):.2f}, last-5 mean {last5:.2f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
