#!/usr/bin/env python3
"""Check (or rewrite) requirements/gpu-lock.txt: re-resolve requirements/gpu.in with a pinned uv and
compare the result with the lock, text for text.

    python3 .ci/check_gpu_lock.py                  # CI: exit 0 when the lock is what gpu.in resolves to
    python3 .ci/check_gpu_lock.py --write          # rewrite the lock (same resolution date)
    python3 .ci/check_gpu_lock.py --write --exclude-newer 2026-12-01T00:00:00Z   # newer releases

The resolution reads metadata only (PEP 658 files or wheel ranges from PyPI; the two sdist-only
packages' metadata from .ci/check_gpu_lock.uv.toml) and downloads no wheel: about 10 s cold. It is
deterministic: `--exclude-newer` (the date in the lock's header) hides every file PyPI received
after the lock was made, so a new upstream release is not drift, while a changed gpu.in, a lock
edited by hand or a conflict is. The transformer-engine-torch entry of the uv.toml is compared with
its sdist's PKG-INFO and setup.py (one 0.25-0.5 MB download): the core it names is the one for the CUDA
major of the lock's torch.

uv 0.13.9 comes from $MRL_UV (a uv binary of that version) or is installed once with this Python's
pip into ~/.cache/megatron-rl/uv-0.13.9. Needs https://pypi.org; without it this fails, saying so.
Standard library only (runs under any Python >= 3.8).
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UV_VERSION = "0.13.9"
INDEX = "https://pypi.org/simple"
LOCK = "requirements/gpu-lock.txt"
UV_CONFIG = ".ci/check_gpu_lock.uv.toml"
DATE = re.compile(r"--exclude-newer (\S+)")


def command(exclude_newer: str) -> list[str]:
    """The resolution, run from the repository root (its arguments are what the lock's header shows)."""
    return ["uv", "pip", "compile", "requirements/gpu.in", "--config-file", UV_CONFIG,
            "--python-version", "3.12", "--python-platform", "x86_64-manylinux_2_34", "--generate-hashes",
            "--index-url", INDEX, "--exclude-newer", exclude_newer, "--no-python-downloads", "--no-header"]


def header(exclude_newer: str) -> str:
    return "\n".join([
        "# The GPU stack, learners and SGLang servers in one environment: Python 3.12, Linux x86_64",
        "# (manylinux_2_34), CUDA 13 (PyPI's torch 2.14.1 for Linux x86_64 is a CUDA 13.0 build; the CUDA",
        "# libraries are the nvidia-*/nvidia-*-cu13 wheels below). Top-level requirements: requirements/gpu.in.",
        f"# Made with uv {UV_VERSION} from the repository root by:",
        "#   " + " ".join(command(exclude_newer)),
        "# `python3 .ci/check_gpu_lock.py --write` runs it; without --write it re-resolves and fails on any",
        "# difference from this file (CI: tests/e2e/test_gpu_lock.py). transformer-engine-torch is an sdist",
        f"# whose metadata comes from {UV_CONFIG} (its own is computed at build time).",
        "# Install: docker/install_lock.sh (docker/Dockerfile.gpu, `make gpu-env`, `make gpu-env-check`; docs/cluster.md),",
        "# pip install --require-hashes --no-deps; Transformer Engine's three pins only in its `te` part (the image's",
        "# `te` target), transformer-engine-torch built there with --no-build-isolation against the torch installed.",
    ]) + "\n"


def fail(msg: str) -> None:
    print(f"check_gpu_lock: {msg}", file=sys.stderr)
    sys.exit(1)


def uv_binary() -> str:
    def version_of(exe: str) -> str:
        try:
            return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    if os.environ.get("MRL_UV"):
        exe = os.environ["MRL_UV"]
        if not version_of(exe).startswith(f"uv {UV_VERSION}"):
            fail(f"MRL_UV={exe} is not uv {UV_VERSION} ({version_of(exe) or 'does not run'})")
        return exe
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron-rl" / f"uv-{UV_VERSION}"
    exe = str(cache / "bin" / "uv")
    if not version_of(exe).startswith(f"uv {UV_VERSION}"):
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "--upgrade", "--target", str(cache), f"uv=={UV_VERSION}"],
                             capture_output=True, text=True)
        if pip.returncode != 0 or not version_of(exe).startswith(f"uv {UV_VERSION}"):
            fail(f"could not install uv {UV_VERSION} into {cache} with {sys.executable} -m pip "
                 f"(is PyPI reachable?):\n{pip.stdout}{pip.stderr}")
    return exe


def resolve(uv: str, exclude_newer: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_") or k == "UV_CACHE_DIR"}
    env["UV_NO_PROGRESS"] = "1"
    run = subprocess.run([uv] + command(exclude_newer)[1:], cwd=REPO, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        offline = any(s in run.stderr for s in ("dns error", "Connect", "error sending request", "timed out"))
        fail(("PyPI could not be reached; this check needs https://pypi.org/simple (no skipping: the lock "
              "is unchecked without it).\n" if offline else
              "requirements/gpu.in does not resolve (a conflict, or a pin PyPI does not have):\n") + run.stderr)
    return header(exclude_newer) + run.stdout


def entries(text: str) -> dict[str, tuple[str, frozenset]]:
    """name -> (version, hashes) of a pip requirements file with hashes."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            name = m.group(1).lower()
            out[name] = (m.group(2), frozenset())
        elif name and "--hash=" in line:
            out[name] = (out[name][0], out[name][1] | {line.split("--hash=")[1].strip(" \\")})
        elif line and not line.startswith(" "):
            name = None
    return out


def differences(lock: str, resolved: str) -> list[str]:
    a, b = entries(lock), entries(resolved)
    out = []
    for name in sorted(set(a) | set(b)):
        if name not in b:
            out.append(f"{name}=={a[name][0]}: in the lock, not in the resolution")
        elif name not in a:
            out.append(f"{name}=={b[name][0]}: resolved, missing from the lock")
        elif a[name][0] != b[name][0]:
            out.append(f"{name}: the lock has {a[name][0]}, the resolution gives {b[name][0]}")
        elif a[name][1] != b[name][1]:
            out.append(f"{name}=={a[name][0]}: hashes differ ({len(a[name][1] ^ b[name][1])} not in both)")
    return out


TE_CORE = re.compile(r"^transformer_engine_cu\d+==")
TE_CORE_LINE = 'te_core = f"transformer_engine_cu{cuda_major_version}=={__version__}"'


def check_static_metadata(lock: str) -> None:
    """The uv.toml's transformer-engine-torch entry must be what its sdist's setup.py gives against the
    lock's torch: the PKG-INFO Requires-Dist with the core named for torch's CUDA major (the PKG-INFO
    names the one of the torch NVIDIA made the sdist with: cu12 for 2.11.0, cu13 for 2.20.2)."""
    config = (REPO / UV_CONFIG).read_text()
    block = config.split('name = "transformer-engine-torch"')[1].split("[[")[0]
    version = re.search(r'version = "([^"]+)"', block).group(1)
    declared = sorted(re.findall(r'^\s+"([^"]+)",', block, re.M))
    pins = entries(lock)
    locked = pins.get("transformer-engine-torch", (None,))[0]
    if locked != version:
        fail(f"the lock has transformer-engine-torch {locked}, {UV_CONFIG} describes {version}: "
             "add that version's metadata (its sdist's PKG-INFO) to the uv.toml")
    # torch's CUDA major: PyPI's Linux torch requires the cuda-toolkit metapackage of its CUDA release.
    if "cuda-toolkit" not in pins:
        fail("the lock has no cuda-toolkit pin (torch's CUDA release), so the CUDA major "
             "transformer-engine-torch's setup.py would build for is unknown")
    cuda_major = pins["cuda-toolkit"][0].split(".")[0]
    req = urllib.request.Request(f"{INDEX}/transformer-engine-torch/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
        sdist = next(f for f in files if f["filename"] == f"transformer_engine_torch-{version}.tar.gz")
        data = urllib.request.urlopen(sdist["url"], timeout=120).read()
    except (OSError, StopIteration) as e:
        fail(f"could not fetch the transformer-engine-torch {version} sdist from PyPI: {e!r}")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        pkg_info = tar.extractfile(f"transformer_engine_torch-{version}/PKG-INFO").read().decode()
        setup_py = tar.extractfile(f"transformer_engine_torch-{version}/setup.py").read().decode()
    if TE_CORE_LINE not in setup_py:
        fail(f"transformer-engine-torch {version}'s setup.py no longer names its core as `{TE_CORE_LINE}`: "
             f"read how it does now and update {UV_CONFIG} and this check")
    actual = sorted(TE_CORE.sub(f"transformer_engine_cu{cuda_major}==", line.split(":", 1)[1].strip())
                    for line in pkg_info.splitlines() if line.startswith("Requires-Dist:"))
    if actual != declared:
        fail(f"{UV_CONFIG}: transformer-engine-torch {version} declares {declared}; built against the "
             f"lock's torch (CUDA {cuda_major}) its sdist gives {actual}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the lock instead of checking it")
    ap.add_argument("--lock", default=LOCK, help=f"the lock to check or write (default {LOCK})")
    ap.add_argument("--exclude-newer", help="resolution date (default: the one in the lock's header)")
    args = ap.parse_args()
    lock_path = Path(args.lock) if Path(args.lock).is_absolute() else REPO / args.lock
    lock = lock_path.read_text() if lock_path.exists() else ""
    found = DATE.search(lock)
    exclude_newer = args.exclude_newer or (found.group(1) if found else None)
    if not exclude_newer:
        fail(f"{lock_path} has no --exclude-newer date in its header: pass --exclude-newer")
    resolved = resolve(uv_binary(), exclude_newer)
    if args.write:
        lock_path.write_text(resolved)
        check_static_metadata(resolved)
        print(f"wrote {lock_path} ({len(entries(resolved))} packages)")
        return
    if lock != resolved:
        diffs = differences(lock, resolved) or ["no pin or hash differs; the header or annotations do:"]
        diff = list(difflib.unified_diff(lock.splitlines(), resolved.splitlines(), str(lock_path),
                                         "resolution", lineterm="", n=1))
        fail(f"{lock_path} is not what requirements/gpu.in resolves to:\n  " + "\n  ".join(diffs)
             + "\n" + "\n".join(diff[:60]) + ("\n..." if len(diff) > 60 else "")
             + "\nIf gpu.in changed on purpose: python3 .ci/check_gpu_lock.py --write")
    check_static_metadata(lock)
    print(f"{lock_path}: matches the resolution of requirements/gpu.in "
          f"({len(entries(lock))} packages, --exclude-newer {exclude_newer})")


if __name__ == "__main__":
    main()
