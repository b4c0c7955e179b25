"""A server started by a trainer never outlives it (rollout/lifeline.py, launch_server
`--exit-with-parent`): here the "server" is a small process running the same watcher, and its parent
is SIGKILLed, the one death nothing in the parent can clean up after. The real servers' flag and
process group are asserted in tests/e2e/test_sglang_rollout.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from megatron_rl.rollout.lifeline import exit_with_parent
    def term(*_):
        # whole or not at all: the test reads the flag as soon as it exists
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write("SIGTERM")
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    exit_with_parent(poll_s=0.05)
    print("ready", flush=True)
    time.sleep(120)
""")

PARENT = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE,
                             text=True, process_group=0)
    assert child.stdout.readline().strip() == "ready"
    print(child.pid, flush=True)
    import time; time.sleep(120)
""")


def test_a_server_exits_once_its_parent_is_killed(tmp_path):
    flag = tmp_path / "terminated"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(flag)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.3)
        assert not flag.exists()  # alive while its parent is
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.read_text() == "SIGTERM"  # the orderly shutdown path, not a kill
    finally:
        parent.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"the child {child} outlived its parent")
