"""Version-guarded patches to upstream packages; `apply_all()` installs the ones this machine needs.

Each patch module has `SUPPORTED` versions and `apply(version=None)`, which refuses any other
version with a message naming the supported one. The CPU layer for megatron-core is applied
only where CUDA is absent; the megatron-core fixes (megatron_fixes.py) and the mbridge fixes always
(a bug that breaks a GPU run is fixed on every device, so that the CPU tests see it too).
"""

from __future__ import annotations

import torch


def apply_all() -> None:
    from patches import mbridge_fixes, megatron_cpu, megatron_fixes
    from patches._guard import pinned, require_version

    # The learner reaches into megatron-core internals on every device (router replay, the grad
    # finaliser, the pipeline schedules), not only through the CPU layer.
    require_version("megatron-core", pinned("megatron-core"), "megatron_rl")
    megatron_fixes.apply()  # every device: MoE without TE, checkpoints without a Manager process
    if not torch.cuda.is_available():
        megatron_cpu.apply()
        from patches import device_check

        if device_check.enabled():  # the CPU test suite: fail where CUDA/NCCL would (device_check.py)
            device_check.install()
    mbridge_fixes.apply()
