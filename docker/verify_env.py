#!/usr/bin/env python3
"""Verify the GPU environment (docs/cluster.md): it is requirements/gpu-lock.txt, and what the project
runs on imports. The last step of both image targets (docker/Dockerfile.gpu) and of
`make gpu-env-check`; runs with or without a GPU.

    python docker/verify_env.py

Checks, each failure listed at the end (exit 1):
  - every pin of the lock is installed at its version, and nothing outside it (megatron-rl and pip
    aside). Transformer Engine's three packages are the optional part: each present one must be the
    lock's; the default image has none of them (and no transformer_engine directory an uninstall left).
  - the installed distributions' own requirements (Requires-Dist, with the extras that are asked for)
    are installed, in their ranges: the runtime dependencies the imports below pull in.
  - torch, megatron.core, mbridge, transformers, flashinfer, sgl_kernel, sglang and its HTTP server,
    megatron_rl (its learner-side modules) and Transformer Engine where installed import, each in its
    own interpreter. Without a GPU driver on the host (no libcuda.so.1), an import that fails only
    because it needs the driver is reported as "needs a GPU driver", not as a failure.
Reports torch's CUDA version and the NCCL it runs with (torch.cuda.nccl.version(), else the installed
nvidia-nccl-cu13's version).

Standard library, plus `packaging` from the lock for reading requirements.
"""

from __future__ import annotations

import ctypes
import importlib.metadata as md
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "gpu-lock.txt"
GPU_IN = REPO / "requirements" / "gpu.in"
TE = ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch")
NOT_FROM_THE_LOCK = {"megatron-rl", "pip"}  # the project (editable) and the venv's own pip
REPORTED_VERSIONS = ("torch", "sglang", "sglang-kernel", "megatron-core", "mbridge", "flashinfer-python",
                     "transformers") + TE
# (module, the distribution that provides it); Transformer Engine's only where installed.
IMPORTS = [
    ("torch", "torch"),
    ("megatron.core", "megatron-core"),
    ("mbridge", "mbridge"),
    ("transformers", "transformers"),
    ("flashinfer", "flashinfer-python"),
    ("sgl_kernel", "sglang-kernel"),
    ("sglang", "sglang"),
    ("sglang.srt.entrypoints.http_server", "sglang"),
    ("megatron_rl", "megatron-rl"),
    ("megatron_rl.models.bridge", "megatron-rl"),
    ("megatron_rl.learner", "megatron-rl"),
    ("megatron_rl.weights.endpoint", "megatron-rl"),
    ("transformer_engine", "transformer-engine"),
    ("transformer_engine.pytorch", "transformer-engine-torch"),
]
# What an import raises on a host with no NVIDIA driver (libcuda.so.1, NVML) when that is the reason.
NEEDS_DRIVER = re.compile(r"libcuda\.so|libnvidia-ml|NVML|[Nn]o (NVIDIA|CUDA) (driver|GPUs?)|"
                          r"CUDA driver|cudaGetDeviceCount|Found no NVIDIA driver|CUDA_ERROR_NO_DEVICE|"
                          r"no CUDA-capable device|nvidia-smi")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    """name -> version of every pin in requirements/gpu-lock.txt."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            pins[norm(m.group(1))] = m.group(2)
    return pins


def installed() -> dict[str, md.Distribution]:
    return {norm(d.metadata["Name"]): d for d in md.distributions()}


def has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def check_pins(pins: dict[str, str], dists: dict[str, md.Distribution]) -> tuple[list[str], list[str]]:
    failures, notes = [], []
    for name, version in sorted(pins.items()):
        if name not in dists:
            if name in TE:
                notes.append(f"{name}: not installed (Transformer Engine is the image's `te` stage)")
            else:
                failures.append(f"{name}=={version}: in the lock, not installed")
        elif dists[name].version != version:
            failures.append(f"{name}: the lock has {version}, installed is {dists[name].version}")
    for name in sorted(set(dists) - set(pins) - NOT_FROM_THE_LOCK):
        failures.append(f"{name}=={dists[name].version}: installed, not in the lock")
    # megatron-core takes an importable transformer_engine for an installed TE; an uninstall leaves
    # its emptied directories, which import as a namespace package.
    if not any(name in dists for name in TE) and importlib.util.find_spec("transformer_engine"):
        where = list(importlib.util.find_spec("transformer_engine").submodule_search_locations or [])
        failures.append(f"transformer_engine imports from {where} with no Transformer Engine installed "
                        "(left by an uninstall?): megatron.core then fails; remove it")
    return failures, notes


def check_requirements(dists: dict[str, md.Distribution]) -> tuple[list[str], list[str]]:
    """Every installed distribution's Requires-Dist (with the extras asked of it by requirements/gpu.in
    and by the other installed distributions) is installed and in range."""
    from packaging.requirements import Requirement

    def reqs(dist):
        for text in dist.requires or ():
            yield Requirement(text)

    def applies(req, extras):
        return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras)

    extras = {name: {""} for name in dists}
    for line in GPU_IN.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            extras.setdefault(norm(req.name), {""}).update(req.extras)
    changed = True
    while changed:  # extras ask for packages whose own extras may be asked for
        changed = False
        for name, dist in dists.items():
            for req in reqs(dist):
                dep = norm(req.name)
                if applies(req, extras[name]) and not req.extras <= extras.setdefault(dep, {""}):
                    extras[dep] |= req.extras
                    changed = True
    failures, notes = [], []
    for name, dist in sorted(dists.items()):
        for req in reqs(dist):
            dep = norm(req.name)
            if not applies(req, extras[name]):
                continue
            if dep not in dists:
                if dep in TE:
                    notes.append(f"{name} asks for {req}: not installed (the `te` stage's)")
                else:
                    failures.append(f"{name} requires {req}: not installed")
            elif not req.specifier.contains(dists[dep].version, prereleases=True):
                failures.append(f"{name} requires {req}: installed is {dists[dep].version}")
    return failures, notes


def try_import(module: str) -> tuple[bool, str, str]:
    """Import `module` in a fresh interpreter: (imported, its traceback, the last lines of it)."""
    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                         timeout=600)
    if run.returncode == 0:
        return True, "", ""
    traceback = run.stderr[run.stderr.find("Traceback"):] if "Traceback" in run.stderr else run.stderr
    lines = [line.strip() for line in traceback.strip().splitlines() if line.strip()]
    return False, traceback, " | ".join(lines[-2:]) or f"exit status {run.returncode}"


def torch_report() -> str:
    code = ("import torch\n"
            "try:\n    nccl = '.'.join(map(str, torch.cuda.nccl.version()))\n"
            "except Exception as e:\n    nccl = 'unknown (' + type(e).__name__ + ')'\n"
            "print(torch.__version__, torch.version.cuda, nccl, torch.cuda.is_available())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        return "torch does not import (see below)"
    version, cuda, nccl, available = run.stdout.split()
    if nccl.startswith("unknown"):
        try:
            nccl = f"{md.version('nvidia-nccl-cu13')} (the installed nvidia-nccl-cu13; torch could not say)"
        except md.PackageNotFoundError:
            nccl = "unknown: torch could not say, nvidia-nccl-cu13 is not installed"
    return f"torch {version}: CUDA {cuda}, NCCL {nccl}, a GPU visible: {available}"


def main() -> int:
    pins, dists = lock_pins(), installed()
    driver = has_driver()
    print(f"verify_env: Python {sys.version.split()[0]} at {sys.prefix}; GPU driver (libcuda.so.1): "
          f"{'present' if driver else 'absent'}; lock {LOCK}")
    failures, notes = check_pins(pins, dists)
    more_failures, more_notes = check_requirements(dists)
    failures += more_failures
    notes += more_notes
    print("versions: " + ", ".join(f"{n} {dists[n].version}" for n in REPORTED_VERSIONS if n in dists))
    print(torch_report())
    for module, dist in IMPORTS:
        if dist not in dists:
            print(f"  {module}: skipped ({dist} not installed)")
            continue
        ok, traceback, error = try_import(module)
        if ok:
            print(f"  {module}: imported")
        elif not driver and (cause := NEEDS_DRIVER.search(traceback)):
            print(f"  {module}: needs a GPU driver (its traceback names {cause.group(0)}): {error}")
        else:
            print(f"  {module}: FAILED")
            failures.append(f"import {module}: {error}")
    for note in notes:
        print(f"  note: {note}")
    if failures:
        print(f"verify_env: {len(failures)} failed:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"verify_env: passed ({len(dists)} distributions, {len(pins)} pins in the lock)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
