"""A server started by a trainer never outlives it.

`exit_with_parent()` (launch_server `--exit-with-parent`, which EngineManager always passes) sends
this process SIGTERM, i.e. SGLang's own orderly shutdown, once the process that started it is gone,
however that ended: SIGKILL, a crash, a closed terminal. The trainer's servers run in process
groups of their own (so that a terminal's Ctrl-C reaches only the trainer), so nothing else would
take them down. It polls the parent pid: prctl's PR_SET_PDEATHSIG follows the *thread* that started
the process, and servers are also restarted from a watchdog thread that may end first.
"""

from __future__ import annotations

import os
import signal
import threading
import time


def exit_with_parent(poll_s: float = 0.5) -> threading.Thread:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread
