"""A child process that must not outlive the process that started it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it ends (PR_SET_PDEATHSIG follows the
    forking *thread*, so start it from one that lives as long as its process); exit at once if
    the parent died before prctl took effect."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
