"""rollout/supervise.py with a stand-in server (a Python one-liner): a crash after the minimum
uptime is restarted with the same command, a crash at start-up and a server out of restarts are
given up (named in the failed file, the server's exit code returned), SIGTERM reaches the server
and ends the supervisor with it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

# Each start appends a line to LOG; the first CRASHES starts exit 3 after UP s, later ones run on.
SERVER = """
import sys, time
log, crashes, up = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with open(log, "a") as f:
    f.write("start\\n")
n = open(log).read().count("start")
time.sleep(up)
if n <= crashes:
    sys.exit(3)
time.sleep(60)
"""


def supervise(tmp_path, crashes, up, *flags):
    cmd = [sys.executable, "-m", "megatron_rl.rollout.supervise", "--failed-file", str(tmp_path / "failed"),
           *flags, "--", sys.executable, "-c", SERVER, str(tmp_path / "starts"), str(crashes), str(up)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def starts(tmp_path) -> int:
    p = tmp_path / "starts"
    return p.read_text().count("start") if p.exists() else 0


def test_crashes_restarted_then_sigterm_forwarded(tmp_path):
    proc = supervise(tmp_path, 2, 0.3, "--restarts", "3", "--min-uptime", "0.2", "--pause", "0.1")
    deadline = time.monotonic() + 30
    while starts(tmp_path) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert starts(tmp_path) == 3  # two crashes, each restarted; the third start runs on
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "server exited (exit code 3) after 0s; restart 1 of 3 in 0.1s" in out, out
    assert "restart 2 of 3 in 0.2s" in out, out
    assert not (tmp_path / "failed").exists()


def test_start_up_crash_and_used_up_restarts_are_given_up(tmp_path):
    proc = supervise(tmp_path, 5, 0.0, "--restarts", "3", "--min-uptime", "30")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3 and starts(tmp_path) == 1, out
    assert "not restarted: it died 0s after its start (--min-uptime 30s)" in out, out
    assert "exit code 3; it died" in (tmp_path / "failed").read_text()
    (tmp_path / "starts").unlink()
    proc = supervise(tmp_path, 5, 0.3, "--restarts", "1", "--min-uptime", "0.2", "--pause", "0.1")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3 and starts(tmp_path) == 2, out
    assert "its 1 restarts are used up" in (tmp_path / "failed").read_text().splitlines()[-1]
