"""A user with an exported proxy that does not answer (and an empty no_proxy) runs `megatron-rl train
tiny_cpu trainer.steps=1`: rank 0 starts its SGLang server, which asks itself for /model_info as it
starts, waits for its health, pushes weights and generates, all direct (rollout/direct.py). Before,
SGLang's start-up request went to the proxy and the run failed after 2 min 40 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.run.metrics import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens there: every connection through it is refused
SHORT = ["trainer.steps=1", "rollout.prompts_per_step=8", "rollout.n_samples=4", "algorithm.mini_batches=2",
         "learner.micro_batch_size=8", "eval.num_prompts=0", "trainer.progress=false", "trainer.plot=false"]
TIMEOUT_S = 600  # about 1 min on 2 cores: server start-up, Megatron init, 1 step


def test_train_with_a_dead_proxy_exported(tmp_path, monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.setenv(name, DEAD_PROXY)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    out_dir = tmp_path / "run"
    start = time.monotonic()
    # No rollout.server_urls: rank 0 starts the server itself, as the user's command does.
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train", "tiny_cpu",
                             f"trainer.out_dir={out_dir}", *SHORT], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the server exits with its parent (--exit-with-parent)
        output, _ = proc.communicate()
        pytest.fail(f"run not finished after {TIMEOUT_S}s; output:\n{output[-4000:]}")
    print(f"tiny_cpu, 1 step, dead proxy exported: {time.monotonic() - start:.0f}s")
    log = out_dir / "server_logs" / "server0.log"
    server_log = log.read_text(errors="replace") if log.exists() else "(no server log)"
    assert proc.returncode == 0, output[-5000:] + "\nserver log tail:\n" + server_log[-3000:]
    assert "megatron-rl: start #0 of server 0" in server_log  # started by rank 0, not given
    assert "ProxyError" not in server_log
    assert '"POST /generate HTTP/1.1" 200' not in server_log  # no access line per request (launch_server.quiet_http)
    assert [r["step"] for r in read_metrics(out_dir) if r["step"] >= 0] == [0]
