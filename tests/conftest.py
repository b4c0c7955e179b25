"""Suite-wide: every process a test starts (spawned ranks, trainer subprocesses, torchrun and Slurm
ranks) runs under the device check (patches/device_check.py): on this CPU-only machine it fails
any code that would put a host tensor into an NCCL collective or mix host and device tensors on
a GPU node. It installs only where CUDA is absent."""

import os

os.environ.setdefault("MRL_DEVICE_CHECK", "1")
