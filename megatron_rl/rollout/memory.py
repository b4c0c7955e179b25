"""Host memory of a rollout producer.

A producer parses responses of tens of MB (a 16k-token answer with top-K log-probs and routed
experts is ~45 MB of JSON) and keeps only their compact records. glibc's malloc raises its mmap
threshold to the size of the first large block freed (up to 32 MiB on 64-bit), after which such
transient buffers come from the heap and stay resident when freed: the process's RSS then grows
with the number of responses parsed, not with what it keeps. Fixing the thresholds (as the
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ variables would) sends blocks above `threshold`
back to the system on free; smaller allocations are unaffected.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def return_large_frees(threshold: int = 4 << 20) -> bool:
    """Fix glibc's mmap and trim thresholds at `threshold` bytes; False where the C library is not
    glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1 and mallopt(M_TRIM_THRESHOLD, threshold) == 1
