"""Process-group setup: the one place that reads the launcher's environment and Megatron's globals.

`init_distributed` reads torchrun (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT) or
Slurm (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, MASTER_ADDR from the first host of
SLURM_JOB_NODELIST) variables, starts torch.distributed (NCCL with CUDA, gloo otherwise),
initialises Megatron's parallel state from the ParallelConfig and returns a `ParallelContext`
holding the explicit process groups. Everything downstream receives groups from that object.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.config.schema import ParallelConfig


@dataclass
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _first_slurm_host(nodelist: str) -> str:
    """First hostname of a Slurm node list, via scontrol when present ("node[01-04]" -> node01)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    m = re.match(r"([^\[,]+)(?:\[(\d+)[^\]]*\])?", nodelist)
    if not m:
        raise RuntimeError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    return m.group(1) + (m.group(2) or "")


def slurm_master_port(env) -> int:
    """The rendezvous port of a Slurm job's attempt: 20000 + (job id mod 5000) x 4 + restart count mod 4."""
    return 20000 + (int(env.get("SLURM_JOB_ID", 0)) % 5000) * 4 + int(env.get("SLURM_RESTART_COUNT", 0)) % 4


def read_launch_env(environ: Optional[dict] = None) -> LaunchEnv:
    """Rank layout from torchrun's variables, else Slurm's (in a job step), else a single process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)))
    # Slurm's task variables name this process's rank only inside a job step (srun sets
    # SLURM_STEP_ID); the batch script itself (an `export` or `eval` run there) also sees
    # SLURM_PROCID=0 and the job's SLURM_NTASKS, but has no peers.
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "localhost"))
        # A port derived from the job id keeps concurrent jobs on one node apart, and from the
        # attempt a requeued job off its failed predecessor's port (as slurm/megatron_rl.sbatch).
        port = int(env.get("MASTER_PORT", slurm_master_port(env)))
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)), addr, port)
    # A lone process: port 0, its store binds whatever port the kernel gives it (so several
    # single-process runs share a machine, and no probed port can be taken before the bind).
    port = int(env.get("MASTER_PORT", 0))
    return LaunchEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), port)


def local_device(local_rank: int, visible: int) -> int:
    """The CUDA device of the rank with `local_rank` on its node, among the `visible` ones: its local
    rank where the node's GPUs are all visible (srun --gpus-per-node), device 0 where the launcher
    binds one GPU per task (--gpus-per-task=1, --gpu-bind=single:1: each task sees only its own)."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise RuntimeError(f"local rank {local_rank} but only {visible} CUDA devices are visible to this task "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): bind all of "
                           "a node's GPUs to every task, or exactly one")
    return local_rank


@dataclass
class ParallelContext:
    """Ranks, sizes and explicit process groups of this process. Pass it (or its groups) down."""

    rank: int
    world_size: int
    device: torch.device
    tp: int
    pp: int
    vpp: Optional[int]
    ep: int
    etp: int
    dp: int
    sequence_parallel: bool
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    etp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup  # dense params' data-parallel group
    ep_group: dist.ProcessGroup
    etp_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup  # tensor x pipeline (model-parallel) group

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def describe(self) -> str:
        return (f"world={self.world_size} tp={self.tp} pp={self.pp} vpp={self.vpp} dp={self.dp} "
                f"ep={self.ep} etp={self.etp} sp={self.sequence_parallel} device={self.device.type}")


def launch_world(cfg) -> int:
    """The world size a launch will have: the launcher's (torchrun, srun), else the recipe's
    `parallel.world_size`, else the smallest the layout fits. `cfg`: the JobConfig."""
    env = read_launch_env()
    return env.world_size if env.world_size > 1 else cfg.parallel.world_size or smallest_world(cfg.parallel)


def smallest_world(cfg: ParallelConfig) -> int:
    """The smallest world size a layout fits: a multiple of both tp·pp and etp·ep·pp."""
    return math.lcm(cfg.tp * cfg.pp, (cfg.etp or 1) * cfg.ep * cfg.pp)


def layout_sizes(cfg: ParallelConfig, world_size: int) -> dict:
    """Validate a layout against the world size; return tp, pp, vpp, ep, etp, dp, sp."""
    tp, pp, ep = cfg.tp, cfg.pp, cfg.ep
    etp = cfg.etp or 1
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp}")
    dp = world_size // (tp * pp)
    if world_size % (etp * ep * pp):
        raise ValueError(f"world size {world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp}")
    if cfg.vpp is not None and cfg.vpp > 1 and pp == 1:
        raise ValueError("parallel.vpp needs parallel.pp > 1")
    sp = (tp > 1) if cfg.sequence_parallel is None else bool(cfg.sequence_parallel)
    if sp and tp == 1:
        sp = False
    vpp = cfg.vpp if cfg.vpp and cfg.vpp > 1 else None
    return dict(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, dp=dp, sequence_parallel=sp)


def check_gpu_python(job, environ=os.environ) -> None:
    """In a Slurm job, a recipe meant for GPUs (`hardware` other than "cpu...") must find CUDA: else it
    would build a 30B model on CPU torch, or fail hours later. Names the Python that found none (the
    usual cause: the submit dir's CPU venv, or a container without a CUDA torch). MRL_ALLOW_CPU=1
    runs it anyway."""
    if not environ.get("SLURM_JOB_ID") or environ.get("MRL_ALLOW_CPU") or job.hardware.lower().startswith("cpu"):
        return
    if torch.cuda.is_available():
        return
    import sys

    build = f"CUDA {torch.version.cuda}, but no GPU is visible" if torch.version.cuda else "a CPU-only build"
    raise ValueError(f"this recipe is for GPUs (hardware: {job.hardware}), and this Python finds none: "
                       f"{sys.executable} (torch {torch.__version__}, {build}). Run it on GPU nodes with a "
                       "CUDA build of torch: set PYTHON=..., or CONTAINER_IMAGE=... / CONTAINER_EXEC=... (the "
                       "container's python3); MRL_ALLOW_CPU=1 runs it on CPU anyway")


# The oldest driver each CUDA major's runtime runs on (CUDA minor-version compatibility, Linux): torch's
# CUDA 13.0 build (requirements/gpu-lock.txt) needs R580. docs/cluster.md, "The driver".
MIN_DRIVER = {13: (580, 65, 6), 12: (525, 60, 13)}
DRIVER_FILE = "/proc/driver/nvidia/version"


def driver_version(path: Optional[str] = None) -> Optional[tuple[int, ...]]:
    """The loaded NVIDIA kernel driver's version (e.g. (535, 129, 3)), None without one."""
    try:
        text = open(path or DRIVER_FILE).read()
    except OSError:
        return None
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def check_driver(job, environ=os.environ, path: Optional[str] = None) -> None:
    """A CUDA build of torch on a node whose driver is older than its CUDA needs finds no GPU, and
    `check_gpu_python` would blame the Python. Refuses naming both versions, unless CUDA works anyway
    (the CUDA forward-compatibility package on LD_LIBRARY_PATH)."""
    if job.hardware.lower().startswith("cpu") or environ.get("MRL_ALLOW_CPU") or not torch.version.cuda:
        return
    found = driver_version(path)
    major = int(torch.version.cuda.split(".")[0])
    need = MIN_DRIVER.get(major)
    if found is None or need is None or found >= need or torch.cuda.is_available():
        return
    show = lambda v: ".".join(f"{x:02d}" if i else str(x) for i, x in enumerate(v))  # noqa: E731
    raise ValueError(f"the NVIDIA driver on this node is {show(found)}; torch {torch.__version__} is a CUDA "
                     f"{torch.version.cuda} build, which needs driver {show(need)} or newer (R{need[0]}), so it "
                     "sees no GPU. Update the driver, or put the CUDA forward-compatibility libraries "
                     f"(cuda-compat-{major}-{torch.version.cuda.split('.')[1]}, data-centre GPUs; in the "
                     "image: /usr/local/cuda/compat) first on LD_LIBRARY_PATH (docs/cluster.md, \"The driver\")")


def init_distributed(cfg: ParallelConfig, timeout_s: float = 1800) -> ParallelContext:
    """Start torch.distributed (if not started) and Megatron's parallel state; return the context.

    `timeout_s` (trainer.collective_timeout) is every process group's timeout: the default group's
    and Megatron's (tensor-, data-, pipeline-, expert-parallel ...)."""
    import patches

    patches.apply_all()
    from megatron.core import parallel_state as mpu

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        env = read_launch_env()
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        if cuda:
            torch.cuda.set_device(local_device(env.local_rank, torch.cuda.device_count()))
        dist.init_process_group("nccl" if cuda else "gloo", rank=env.rank,
                                world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    s = layout_sizes(cfg, world)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=s["tp"],
        pipeline_model_parallel_size=s["pp"],
        virtual_pipeline_model_parallel_size=s["vpp"],
        expert_model_parallel_size=s["ep"],
        expert_tensor_parallel_size=s["etp"],
        distributed_timeout_minutes=timeout_s / 60,  # Megatron's groups: the same timeout as the default one
    )
    from patches import device_check

    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        # Under the CPU suite's device check a virtual CUDA device (the CPU layer places it on
        # the CPU), so that tensors put "on the device" can be told from host ones.
        device = torch.device("cuda" if device_check.installed() else "cpu")
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=world,
        device=device,
        tp=s["tp"], pp=s["pp"], vpp=s["vpp"], ep=s["ep"], etp=s["etp"], dp=s["dp"],
        sequence_parallel=s["sequence_parallel"],
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
        ep_group=mpu.get_expert_model_parallel_group(),
        etp_group=mpu.get_expert_tensor_parallel_group(),
        expert_dp_group=mpu.get_expert_data_parallel_group(),
        mp_group=mpu.get_model_parallel_group(),
    )
