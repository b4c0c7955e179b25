"""Asynchronous training through the real trainer (real Megatron-Core learner, real SGLang server).

- trainer.max_staleness=0 is the synchronous loop, bit for bit: the metrics of a seeded run equal
  those recorded from the loop before the producer thread existed (tests/e2e/data/
  sync_golden_tiny_cpu.json, made at git cb2010e; the comparison needs the same CPU, torch,
  megatron-core and SGLang, which the file records);
- max_staleness=1 without partial rollouts (drain) is exactly one step off-policy at every step
  after the first, and kill -9 then resume gives the same run bit for bit (the producer's queued
  share is saved in the checkpoint and trained on after the resume);
- partial rollouts with the server killed mid-run: the run completes, every step trains on new
  prompts (no prompt lost or repeated), no token is older than the bound, cut responses were
  continued under new weights.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import time
from importlib.metadata import version
from pathlib import Path

import psutil
import pytest
import torch

from megatron_rl.trainer.metrics import read_metrics
from tests.e2e.test_trainer import SMALL, cli, run, server_url, wait_for_checkpoint  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).parent / "data" / "sync_golden_tiny_cpu.json"
K0_ARGS = ["eval.num_prompts=8", "eval.k=2", "eval.every=2", "trainer.steps=3"]
VOLATILE = ("time/", "rollout/retries", "async/queue_depth")


def fingerprint() -> dict:
    cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    return {"torch": torch.__version__, "sglang": version("sglang"), "megatron-core": version("megatron-core"),
            "machine": platform.machine(), "cpu": cpu, "avx512f": "avx512f" in flags}


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def test_k0_is_the_synchronous_loop_bit_for_bit(server_url, tmp_path):  # noqa: F811
    golden = json.loads(GOLDEN.read_text())
    if golden["fingerprint"] != fingerprint():
        pytest.skip(f"the golden was recorded on {golden['fingerprint']}, this is {fingerprint()}: "
                    "other kernels round differently (re-record it with the module docstring's commit)")
    run(tmp_path / "k0", server_url, "trainer.max_staleness=0", *K0_ARGS, small=False)
    rows = read_metrics(tmp_path / "k0")
    assert [r["step"] for r in rows] == [r["step"] for r in golden["rows"]] == [-1, 0, 1, 2]
    for want, got in zip(golden["rows"], rows):
        diff = {k: (v, got.get(k)) for k, v in want.items() if got.get(k) != v}
        assert not diff, f"step {want['step']}: {diff}"
    steps = [r for r in rows if r["step"] >= 0]
    assert all(r["async/staleness_max"] == 0 and r["async/tokens_staleness_0"] > 0 for r in steps)
    assert any(r["rollout/accuracy"] > 0 for r in steps)  # the golden trains on real rewards


def test_one_step_off_drain_is_exact_and_resumes_bit_for_bit(server_url, tmp_path):  # noqa: F811
    args = ["trainer.max_staleness=1", "trainer.steps=5", "trainer.save_every=1"]
    straight = tmp_path / "straight"
    run(straight, server_url, *args)
    a = [r for r in read_metrics(straight) if r["step"] >= 0]
    for r in a:
        # Drain: step t's tokens are all from the weights of step t-1 (t >= 1), i.e. exactly one
        # step off-policy; step 0's from the initial weights.
        assert r["async/staleness_max"] == min(r["step"], 1) == r["async/staleness_mean"], r
        assert r["async/old_token_frac"] == min(r["step"], 1)
        assert r["async/tokens_staleness_0"] + r["async/tokens_staleness_1"] > 0
        # The trust-region diagnostics split by staleness: every token is fresh at step 0 and
        # stale after; stale tokens meet a policy that has moved since they were sampled.
        assert (r["stale/tokens"], r["fresh/tokens"]) == ((r["tokens"], 0.0) if r["step"] else (0.0, r["tokens"]))
    assert all(r["stale/abs_logp_diff/mean"] > 0 for r in a[1:])
    digests = [r["data/prompt_digest"] for r in a]
    assert len(set(digests)) == len(digests)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(cli(killed, server_url, *args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for_checkpoint(killed, 2, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    # The checkpoint holds the producer's share of step 2 (made under the weights of step 1).
    assert (killed / "checkpoints" / "step_00000002" / "queue" / "t00000002.dp0.pt").exists()
    out = run(killed, server_url, *args)
    assert "at step 2" in out.stdout
    b = [r for r in read_metrics(killed) if r["step"] >= 0]
    b = [r for i, r in enumerate(b) if r["step"] not in [x["step"] for x in b[i + 1:]]]  # the resumed rows win
    assert [r["step"] for r in b] == list(range(5))
    for ra, rb in zip(stable(a), stable(b)):
        diff = {k: (ra.get(k), rb.get(k)) for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)}
        assert not diff, f"step {ra['step']}: {diff}"


def _rows(out_dir: Path) -> list[dict]:
    return read_metrics(out_dir) if (out_dir / "metrics.jsonl").exists() else []


def _sglang_servers(root: psutil.Process) -> list[psutil.Process]:
    return [p for p in root.children(recursive=True)
            if "megatron_rl.rollout.launch_server" in " ".join(p.cmdline())]


def test_partial_rollouts_survive_a_killed_server(tmp_path):
    """Local placement (the trainer's own server, which its manager restarts): kill the server
    while the producer generates ahead; the run completes with every step's prompts new."""
    out_dir = tmp_path / "partial"
    args = ["trainer.max_staleness=1", "rollout.partial_rollouts=true", "rollout.max_new_tokens=24",
            "rollout.max_total_tokens=8192", "trainer.steps=6"]
    cmd = [a for a in cli(out_dir, "", *args) if not a.startswith("rollout.server_urls")]
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not any(r["step"] >= 1 for r in _rows(out_dir)):
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-5000:]
            time.sleep(0.2)
        victims = _sglang_servers(psutil.Process(proc.pid))
        assert victims, "no SGLang server under the trainer"
        for v in victims:
            for p in [v, *v.children(recursive=True)]:
                p.kill()
        assert proc.wait(timeout=900) == 0, (tmp_path / "log.txt").read_text()[-8000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "log.txt").read_text()
    rows = [r for r in read_metrics(out_dir) if r["step"] >= 0]
    assert [r["step"] for r in rows] == list(range(6))
    digests = [r["data/prompt_digest"] for r in rows]
    assert len(set(digests)) == len(digests), digests  # no step's prompts lost or used twice
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert sum(r["async/continued_samples"] for r in rows) > 0  # responses cut at a push went on
    assert sum(r["async/multi_version_samples"] for r in rows) > 0
    assert "restart" in text.lower(), text[-3000:]  # the manager brought the server back
    print({r["step"]: (r["async/staleness_mean"], r["async/continued_samples"], r["async/regenerated_steps"],
                       r["rollout/retries"]) for r in rows})
