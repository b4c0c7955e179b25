"""Shared pieces of the GPU smoke suite (tests/gpu): where it runs, what it reads, where figures go.

The suite is written for one H100 (80 GB) whose image has Python 3.12, torch + CUDA and
transformers but none of megatron-core, mbridge, hydra or SGLang: those travel as wheels, and the
loop trains on rollouts saved on CPU beforehand (`tests/gpu/suite.sh prepare`, docs/gpu.md).

Environment:
  MRL_GPU_SUITE_DEVICE  cuda (default: the suite fails, never skips, without a CUDA device) | cpu
                        (the dry run: the same code paths with tiny shapes, fp32 and gloo, to catch
                        Python-level errors before GPU time is spent; tests/e2e/test_gpu_suite_dry_run.py)
  MRL_GPU_DIR           the prepared folder (default <repo>/.gpu): data/ (saved rollouts, the HF
                        checkpoints they came from, manifest.json) and wheels/
  MRL_GPU_FIGURES       the figures JSON of (c) and (d) (default $OUT/gpu_figures.json where OUT is
                        set, else <MRL_GPU_DIR>/out/gpu_figures.json)

Every measurement runs in a fresh spawned process (`run_isolated`) that owns the device and one
world-size-1 process group: NCCL on CUDA (NCCL refuses two ranks on one GPU), gloo on CPU. Megatron's
parallel state and the GPU memory of one model are then gone before the next test starts.
"""

from __future__ import annotations

import io
import json
import os
import queue as queue_mod
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]

# The loop's saved rollouts. The same overrides write them (trainer.mode=rollout_only, prepare.py)
# and train on them (trainer.mode=train_only, test_gpu_loop.py): one list, so the two cannot drift.
# 16 prompts x 8 samples per step: with a random policy (~1 % correct answers) most steps still
# hold a group with a non-zero advantage; the entropy bonus moves the policy on every step either
# way, so the checkpoint/resume comparison compares weights that actually change.
ROLLOUT_STEPS = 8
LOOP_OVERRIDES = [
    "rollout.prompts_per_step=16", "rollout.n_samples=8", "algorithm.mini_batches=2",
    "learner.micro_batch_size=32", "eval.num_prompts=0", "trainer.progress=false",
    "trainer.plot=false", "algorithm.entropy_coef=0.01",
]
LOOP_MODELS = {
    "dense": "tiny_cpu",  # tiny Qwen3, DPPO binary-TV
    "moe": "tiny_moe_cpu_r3",  # tiny Qwen3-MoE (4 experts, top-2) with R3 routes from SGLang
}


def device() -> str:
    name = os.environ.get("MRL_GPU_SUITE_DEVICE", "cuda")
    if name not in ("cuda", "cpu"):
        raise ValueError(f"MRL_GPU_SUITE_DEVICE={name!r}; valid: cuda, cpu (the CPU dry run)")
    return name


def cuda() -> bool:
    return device() == "cuda"


def ctx_device() -> str:
    """The device the package's ParallelContext names (and `describe()` prints): cuda on the GPU,
    and also in the CPU dry run when the suite-wide device check is on (tests/conftest.py sets
    MRL_DEVICE_CHECK=1; patches/device_check.py then simulates GPU placement on CPU and fails
    where CUDA/NCCL would); cpu otherwise."""
    return "cuda" if cuda() or os.environ.get("MRL_DEVICE_CHECK") == "1" else "cpu"


def gpu_dir() -> Path:
    return Path(os.environ.get("MRL_GPU_DIR", REPO / ".gpu"))


def data_dir() -> Path:
    return gpu_dir() / "data"


def figures_path() -> Path:
    if os.environ.get("MRL_GPU_FIGURES"):
        return Path(os.environ["MRL_GPU_FIGURES"])
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_figures.json"
    return gpu_dir() / "out" / "gpu_figures.json"


def manifest() -> dict:
    path = data_dir() / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `tests/gpu/suite.sh prepare` first (it saves the "
                                "rollouts and the HF checkpoints the loop trains on)")
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------
def environment() -> dict:
    """Versions and device of this run, recorded beside the figures."""
    from importlib import metadata

    import torch

    env = {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "device_kind": device(),
           "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("megatron-core", "mbridge", "transformers", "hydra-core"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if cuda() and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   sm_count=props.multi_processor_count, driver=_nvidia_smi("driver_version"))
    env.update(_commit())
    return env


def _nvidia_smi(field: str):
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _commit() -> dict:
    """The commit the suite runs: MRL_GPU_COMMIT (suite.sh sets it from git where the checkout
    has .git; a copied tree has none), else git here, else the commit `prepare` recorded (the
    tree may have changed since: `prepare_commit` says which one that was)."""
    import subprocess

    out = {"commit": os.environ.get("MRL_GPU_COMMIT") or None, "tree_dirty": None}
    if out["commit"] is None:
        try:
            head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=20)
            if head.returncode == 0:
                out["commit"] = head.stdout.strip()
                dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                       capture_output=True, text=True, timeout=20)
                out["tree_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        out["prepare_commit"] = manifest().get("commit")
    except FileNotFoundError:
        out["prepare_commit"] = None
    out["commit"] = out["commit"] or out["prepare_commit"]
    return out


def record(section: str, values: dict) -> None:
    """Merge `values` into figures[section] and rewrite the figures file at once (a later crash
    or timeout keeps what was measured before it)."""
    path = figures_path()
    figures = json.loads(path.read_text()) if path.exists() else {}
    if "environment" not in figures:
        figures["environment"] = environment()
    figures.setdefault(section, {}).update(values)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(figures, indent=1, sort_keys=True))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# one process per measurement
# ---------------------------------------------------------------------------------------------
def _child(fn: Callable, args: tuple, queue) -> None:
    # Port 0: the group's store binds a port the kernel picks (a probed free port could be taken
    # by another process before the bind).
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0")
    try:
        import torch

        result = fn(*args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((True, buf.getvalue()))
    except BaseException:  # every failure, SystemExit from a config error included
        queue.put((False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_isolated(fn: Callable, *args: Any, timeout: float = 600.0) -> Any:
    """fn(*args) in a fresh process (spawned on CUDA; on CPU, the dry run, forked from the fork server
    of megatron_rl.distributed.spawn, which imported torch and megatron-core once); its return value
    (torch.save-able) comes back, its exception is re-raised here with the child's traceback. `fn`
    must be a module-level function."""
    import torch

    from megatron_rl.distributed import spawn

    queue = spawn.context().Queue()
    proc = spawn.process(_child, fn, args, queue)
    proc.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                ok, payload = queue.get(timeout=1.0)
                break
            except queue_mod.Empty:
                if proc.exitcode is not None:
                    raise RuntimeError(f"{fn.__name__} died without a report (exit code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} did not finish in {timeout:.0f}s")
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed in its process:\n{payload}")
    return torch.load(io.BytesIO(payload), weights_only=False)


def start_group():
    """In a `run_isolated` child: torch.distributed + Megatron's parallel state (world size 1)
    through the package's own init, and a check that it picked NCCL on CUDA, gloo on CPU."""
    import torch
    import torch.distributed as dist

    from megatron_rl.config.schema import ParallelConfig
    from megatron_rl.distributed.context import init_distributed

    if cuda() and not torch.cuda.is_available():
        raise RuntimeError("MRL_GPU_SUITE_DEVICE=cuda but torch sees no CUDA device")
    ctx = init_distributed(ParallelConfig())
    want = "nccl" if cuda() else "gloo"
    if dist.get_backend() != want or ctx.device.type != ctx_device():
        raise RuntimeError(f"expected backend {want} on {ctx_device()}, got {dist.get_backend()} on {ctx.device}")
    return ctx


def synchronize() -> None:
    import torch

    if cuda():
        torch.cuda.synchronize()
