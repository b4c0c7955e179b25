"""A stand-in learner rank that implements exactly the trainer's launch contract, nothing else.

Used by tests/slurm/test_sbatch.py to test the sbatch script's signal path (USR1 -> srun -> every
rank; wait; requeue; resume in the same run dir) in seconds and independently of the trainer:

    contract_rank.py RECIPE [key=value ...]   reads train.out_dir=, train.steps=,
                                              rollout.server_urls=[URL,...] (disaggregated)

Given server URLs, every rank first asks each server for a few tokens (POST /generate) and writes
what came back to <out_dir>/rollout-rank<R>.json. Then each "step" sleeps STEP_S; rank 0 appends
{"step", "attempt"} to <out_dir>/metrics.jsonl; a step ends when every rank has done it
(`progress-rank<R>-attempt<N>`), as collectives would make it. On
SIGUSR1 or SIGTERM a rank finishes its step, rank 0 writes <out_dir>/checkpoints/latest (the
step reached), every rank records `preempted-rank<R>-attempt<N>` and exits 0. On start it resumes
from checkpoints/latest. Ranks come from Slurm's variables, as the trainer reads them.

CONTRACT_CRASH=R:K:C makes rank R fail at the K-th step of every attempt, counted from when every
rank is up (`started-rank<R>-attempt<N>`): C=1 raises (a
RuntimeError's traceback, exit 1), C=2 exits 2 with the CLI's one-line configuration error. (srun
then ends the other rank with SIGTERM, which it takes as a preemption: rank 0, if it is the other,
checkpoints.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

STEP_S = 0.5


def main(argv: list[str]) -> int:
    kv = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    out = Path(kv["train.out_dir"])
    steps = int(kv.get("train.steps", 20))
    rank = int(os.environ["SLURM_PROCID"])
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", 0))
    stop = []
    signal.signal(signal.SIGUSR1, lambda *_: stop.append("USR1"))
    signal.signal(signal.SIGTERM, lambda *_: stop.append("TERM"))
    ckpt = out / "checkpoints" / "latest"
    step = int(ckpt.read_text()) if ckpt.exists() else 0
    print(f"rank {rank}/{os.environ['SLURM_NTASKS']} attempt {attempt}: resuming at step {step}",
          flush=True)
    urls = kv.get("rollout.server_urls", "[]").strip("[]").split(",")
    if urls != [""]:
        replies = {}
        for url in urls:
            req = urllib.request.Request(
                # the job's key (megatron_rl/rollout/auth.py: the sbatch makes it, the servers require it)
                url + "/generate", headers={"Content-Type": "application/json",
                                            "Authorization": f"Bearer {os.environ['MRL_SGLANG_API_KEY']}"},
                data=json.dumps({"input_ids": [5, 6, 7],
                                 "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).encode())
            with urllib.request.urlopen(req, timeout=120) as r:
                replies[url] = json.loads(r.read())["output_ids"]
        (out / f"rollout-rank{rank}.json").write_text(json.dumps(replies))
    crash = [int(x) for x in os.environ["CONTRACT_CRASH"].split(":")] if os.environ.get("CONTRACT_CRASH") else None
    # Up, its signal handlers in place: a rank that crashes counts its steps only once every other
    # rank is, or srun's SIGTERM could reach one still starting (under load a rank starts seconds
    # after another) and end it without the checkpoint a preemption writes.
    (out / f"started-rank{rank}-attempt{attempt}").write_text("")
    if crash and crash[0] == rank:
        others = [out / f"started-rank{r}-attempt{attempt}" for r in range(int(os.environ["SLURM_NTASKS"])) if r != rank]
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    start = step
    peers = [out / f"progress-rank{r}-attempt{attempt}" for r in range(int(os.environ["SLURM_NTASKS"])) if r != rank]
    while step < steps:
        time.sleep(STEP_S)
        step += 1
        if crash and crash[:2] == [rank, step - start]:
            if crash[2] == 2:
                print("megatron-rl: error: injected configuration error", file=sys.stderr, flush=True)
                return 2
            raise RuntimeError(f"injected failure at step {step}")
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "attempt": attempt}) + "\n")
        # A step ends when every rank has done it, as the trainer's collectives make it: a rank never
        # runs past a peer that failed (it waits for srun's SIGTERM), so it cannot finish the run
        # while another rank's failure is being reported.
        done = out / f"progress-rank{rank}-attempt{attempt}"
        done.with_suffix(".tmp").write_text(str(step))
        done.with_suffix(".tmp").replace(done)
        deadline = time.monotonic() + 120
        while not stop and not all(p.exists() and int(p.read_text() or 0) >= step for p in peers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: the other ranks did not finish step {step} in 120 s")
            time.sleep(0.02)
        if stop:
            if rank == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                ckpt.write_text(str(step))
            (out / f"preempted-rank{rank}-attempt{attempt}").write_text(stop[0])
            print(f"rank {rank}: {stop[0]} -> checkpoint at step {step}, exit 0", flush=True)
            return 0
    (out / f"finished-rank{rank}").write_text(str(step))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
