"""How fast this machine runs what the test suite spends its time on, against the machine the
budget was measured on (`.ci/run`'s SUITE_BUDGET_S): prints one number, the slowdown (>= 1).

Two probes, each the best of two or five runs (about 15 s in all): a fresh interpreter importing torch, transformers and
megatron-core (every spawned trainer, rank and server pays such imports), and a tiny model's
training arithmetic in Python and torch (what a CPU test's steps are). The slowdown is the larger
of the two ratios to REFERENCE, measured on the 2-core machine the budget comes from.
"""

from __future__ import annotations

import subprocess
import sys
import time

REFERENCE = {"imports_s": 5.8, "compute_s": 0.56}  # `python .ci/speed.py --measure` there, 2026-11-26 (steady to 2 %)


def imports_s() -> float:
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, transformers, megatron.core"], check=True,
                       capture_output=True)
        best = min(best, time.perf_counter() - t)
    return best


def compute_s() -> float:
    import torch

    torch.set_num_threads(1)  # steadier than two threads on a shared 2-core machine
    torch.manual_seed(0)
    w = [torch.randn(256, 256, requires_grad=True) for _ in range(4)]
    x = torch.randn(64, 256)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(300):
            h = x
            for m in w:
                h = torch.tanh(h @ m)
            h.square().mean().backward()
            with torch.no_grad():
                for m in w:
                    m -= 1e-3 * m.grad
                    m.grad = None
        sum(i * i for i in range(1_000_000))  # the Python side of a step
        best = min(best, time.perf_counter() - t)
    return best


if __name__ == "__main__":
    measured = {"imports_s": imports_s(), "compute_s": compute_s()}
    if "--measure" in sys.argv:
        print(measured)
    else:
        ratios = {k: measured[k] / REFERENCE[k] for k in REFERENCE}
        print(f"{max(1.0, *ratios.values()):.2f}")
        print(f"speed: {measured} against {REFERENCE}", file=sys.stderr)
