"""The README's multi-process launch, end to end: `torchrun --nproc-per-node 2 -m megatron_rl.cli
train tiny_cpu parallel.tp=2`, shortened (2 steps, a small batch).

Rank 0 starts the SGLang server itself (no `rollout.server_urls`), so the server is a child of a
torchrun worker: this is the path on which a server that inherited torchrun's rendezvous
variables hung at "Init parallel begin" and the run never started (and, with that fixed, rank 0's
weight-update group waited for a store torchrun's agent does not host). The test asserts that the
run finishes in bounded time with a real TP=2 learner; that the server took every weight push
(its own log of weight versions); that every step's rollouts came from the weights just pushed
(the server's log-probs agree with the TP=2 learner's on them, while weights one optimizer step
apart are far off); and that no process of the run outlives it. On a timeout every process of
the run, found by a marker in its environment, is killed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megatron_rl.rollout.server import free_port
from megatron_rl.run.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
# In 2 steps of 8 x 4 samples a random policy rarely earns a reward: with all advantages zero the
# weights would not move and a sync that never happened would go unseen. The entropy bonus moves
# them at every optimizer step.
SHORT = [f"trainer.steps={STEPS}", "rollout.prompts_per_step=8", "rollout.n_samples=4",
         "algorithm.mini_batches=2", "learner.micro_batch_size=8", "eval.num_prompts=0",
         "algorithm.entropy_coef=0.01", "trainer.progress=false", "trainer.plot=false"]
TIMEOUT_S = 300  # about 1 min on 2 cores: server start-up, Megatron init, 2 steps, checkpoint
MARKER = "MEGATRON_RL_TEST_RUN"  # in every process of the run: orphans are found by it


def run_processes(token: str) -> list[psutil.Process]:
    """Every live process of this run (torchrun, its workers, the servers and their children)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARKER) == token:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def kill_run(token: str) -> None:
    """SIGSTOP every process of the run until none is new (so none can spawn another), then
    SIGKILL them all. torchrun's workers are in sessions of their own and the server's processes
    in rank 0's group, so one killpg would not reach them all."""
    stopped: dict[int, psutil.Process] = {}
    while new := [p for p in run_processes(token) if p.pid not in stopped]:
        for p in new:
            try:
                p.suspend()
            except psutil.NoSuchProcess:
                pass
            stopped[p.pid] = p
    for p in stopped.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def test_torchrun_tp2_as_in_readme(tmp_path):
    out_dir = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    # The README's command; its own rendezvous port so that it cannot meet another job's on 29500.
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "megatron_rl.cli", "train", "tiny_cpu", "parallel.tp=2",
           f"trainer.out_dir={out_dir}", *SHORT]
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), MARKER: token}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_run(token)
        output, _ = proc.communicate()
        server_log = out_dir / "server_logs" / "server0.log"
        tail = server_log.read_text(errors="replace")[-3000:] if server_log.exists() else "(no server log)"
        pytest.fail(f"torchrun TP2 run not finished after {TIMEOUT_S}s; output:\n{output[-4000:]}\n"
                    f"server log tail:\n{tail}")
    finally:
        if proc.poll() is None:
            kill_run(token)
            proc.wait()
    elapsed = time.monotonic() - start
    print(f"torchrun TP2, {STEPS} steps: {elapsed:.0f}s")
    assert proc.returncode == 0, output[-6000:]

    # Rank 0's layout line: two ranks, one tensor-parallel group of 2.
    assert "[megatron-rl] tiny_cpu: world=2 tp=2 pp=1 vpp=None dp=1" in output, output[-3000:]
    # The server was started by rank 0 (not given), and it took every push: the initial weights
    # (version 0), then one per step, as its own log records them.
    log = (out_dir / "server_logs" / "server0.log").read_text(errors="replace")
    assert "megatron-rl: start #0 of server 0" in log
    versions = re.findall(r"Weight version changed\. old_version='([^']*)' new_version='([^']*)'", log)
    assert versions == [("default", "0")] + [(str(v), str(v + 1)) for v in range(STEPS)], versions

    rows = [r for r in read_metrics(out_dir) if r["step"] >= 0]
    assert [r["step"] for r in rows] == list(range(STEPS))
    for r in rows:
        assert r["weight_version"] == r["step"] + 1  # logged after the step's push
        assert r["weight_sync/bytes"] > 0 and r["grad_norm"] > 0
        # The rollouts came from the weights the TP=2 learner had just pushed: on its first
        # mini-batch (those weights) learner and server agree on the log-probs to fp32 noise
        # (about 2e-7 here); averaged with the second mini-batch, one optimizer step further, the
        # gap is about 0.1 at step 0 and 0.02 at step 1. Rollouts from weights that missed a push
        # would be that far off.
        assert r["mismatch/train_vs_rollout_abs_logp"] < 1e-5, r
        assert r["abs_logp_diff/mean"] > 1e-3, r
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"

    # Rank 0 stopped its server on the way out; the scheduler children exit on their own.
    deadline = time.monotonic() + 30
    while (left := run_processes(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        names = [(p.pid, p.name()) for p in left]
        kill_run(token)
        pytest.fail(f"processes of the run outlived it: {names}")
