"""Preparation of the GPU smoke suite, on a machine with PyPI and SGLang (this one, or CI).

    python tests/gpu/prepare.py wheels [--check-only]   download tests/gpu/wheels.txt into <gpu dir>/wheels
    python tests/gpu/prepare.py data                    save the loop's rollouts + HF checkpoints in <gpu dir>/data
    python tests/gpu/prepare.py size                    what travels to the GPU machine must be < 64 MiB

<gpu dir> is $MRL_GPU_DIR (default <repo>/.gpu, ignored by git). The GPU machine has Python 3.12,
torch, transformers (tests/gpu/image-packages.txt) and no network: what else the suite needs
travels as wheels, and the loop trains on rollouts saved here by SGLang (`trainer.mode=rollout_only`,
CPU). `wheels --check-only` checks the list without downloading (versions = requirements/cpu-lock.txt,
every wheel requirement resolves, nothing shadows an image package) from the recorded metadata.
`check_imports` checks a traced run (tests/gpu/trace_imports.py); test_gpu_loop.py traces the
loop's train_only runs with it, so the CPU dry run finds a package the GPU machine lacks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common  # noqa: E402

REPO = gpu_common.REPO
HERE = Path(__file__).resolve().parent
LIMIT_MIB = 64
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# Marker environment of the GPU machine (prepare may run under another Python).
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
# Standard-library modules Python 3.12 removed: importable here (3.11), missing there.
REMOVED_IN_312 = {"distutils", "imp", "asynchat", "asyncore", "smtpd"}
PROJECT = {"megatron_rl", "patches", "__main__", "gpu_common", "trace_imports"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class Pin:
    def __init__(self, line: str):
        spec, self.source, self.sha256, size = line.split()
        self.name, self.version = spec.split("==")
        self.bytes = int(size)
        if self.source not in ("wheel", "sdist"):
            raise ValueError(f"tests/gpu/wheels.txt: {line!r}: source must be wheel or sdist")

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


def read_pins() -> list[Pin]:
    return [Pin(l) for l in (HERE / "wheels.txt").read_text().splitlines() if l.strip() and not l.startswith("#")]


def read_image() -> dict[str, str | None]:
    out = {}
    for line in (HERE / "image-packages.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            out[norm(name)] = version or None
    return out


def read_lock() -> dict[str, str]:
    out = {}
    for line in (REPO / "requirements" / "cpu-lock.txt").read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==(\S+)", line.strip())
        if m:
            out[norm(m.group(1))] = m.group(3)
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheels_dir() -> Path:
    return gpu_common.gpu_dir() / "wheels"


# ---------------------------------------------------------------------------------------------
# wheels
# ---------------------------------------------------------------------------------------------
def _pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")


def download(pins: list[Pin], dest: Path) -> list[Path]:
    """Each pin into `dest` (emptied first: two versions of one package would stop the install)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    files = []
    with tempfile.TemporaryDirectory() as tmp:
        for pin in pins:
            got = Path(tmp) / pin.name
            got.mkdir()
            if pin.source == "wheel":
                _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                     "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)],
                     "-d", str(got), pin.spec)
            else:
                _pip("download", "--no-deps", "--no-binary=:all:", "-d", str(got), pin.spec)
            (path,) = list(got.iterdir())
            if sha256(path) != pin.sha256:
                raise RuntimeError(f"{path.name}: sha256 {sha256(path)} != {pin.sha256} recorded in "
                                   "tests/gpu/wheels.txt (a different file than the one checked)")
            if pin.source == "sdist":
                built = Path(tmp) / f"{pin.name}-built"
                _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(built), str(path))
                (path,) = list(built.glob("*.whl"))
                if "py3-none-any" not in path.name:
                    raise RuntimeError(f"{path.name}: built from the sdist, but not a pure-Python wheel")
            shutil.copy(path, dest / path.name)
            files.append(dest / path.name)
    return files


def wheel_requirements(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
    return [l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("Requires-Dist:")]


def check_set(pins: list[Pin], requirements: dict[str, list[str]]) -> list[str]:
    """Problems of the pin set: versions vs the CPU lock, shadowed image packages, unresolved
    requirements (markers evaluated for the GPU machine's Python 3.12 / Linux x86-64)."""
    from packaging.requirements import Requirement

    image, lock = read_image(), read_lock()
    have = {norm(p.name): p.version for p in pins}
    problems = []
    for p in pins:
        if lock.get(norm(p.name)) != p.version:
            problems.append(f"{p.spec}: requirements/cpu-lock.txt pins {lock.get(norm(p.name))}")
        if norm(p.name) in image:
            problems.append(f"{p.spec} would shadow the image's own {p.name} (PYTHONPATH comes first)")
    for pkg, reqs in requirements.items():
        for text in reqs:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
                continue  # extras and other Pythons' needs
            name = norm(req.name)
            version = have.get(name, image.get(name))
            if name not in have and name not in image:
                problems.append(f"{pkg} requires {text}: neither a wheel of tests/gpu/wheels.txt nor "
                                "in the image (tests/gpu/image-packages.txt)")
            elif version is not None and req.specifier and version not in req.specifier:
                problems.append(f"{pkg} requires {text}, but {req.name} {version} is what the GPU machine gets")
    return problems


def cmd_wheels(args) -> int:
    pins = read_pins()
    if args.check_only:
        reqs = json.loads((HERE / "wheel-requirements.json").read_text())
        missing = sorted({p.name for p in pins} ^ set(reqs))
        problems = [f"wheel-requirements.json and wheels.txt list different packages: {missing}"] if missing else []
    else:
        files = download(pins, wheels_dir())
        reqs = {p.name: wheel_requirements(f) for p, f in zip(pins, files)}
        for p, f in zip(pins, files):
            if f.stat().st_size != p.bytes:
                print(f"note: {f.name} is {f.stat().st_size} bytes; wheels.txt records {p.bytes}")
        if args.record:
            (HERE / "wheel-requirements.json").write_text(json.dumps(reqs, indent=1, sort_keys=True) + "\n")
        recorded = json.loads((HERE / "wheel-requirements.json").read_text())
        problems = [f"{n}: Requires-Dist {reqs[n]} differ from tests/gpu/wheel-requirements.json {recorded.get(n)} "
                    "(run `prepare.py wheels --record` and review)" for n in reqs if reqs[n] != recorded.get(n)]
    problems += check_set(pins, reqs)
    total = sum(p.bytes for p in pins)
    print(f"wheel set: {', '.join(p.spec for p in pins)}; {total / 2**20:.2f} MiB")
    for p in problems:
        print("problem:", p)
    return 1 if problems else 0


# ---------------------------------------------------------------------------------------------
# data: the loop's saved rollouts
# ---------------------------------------------------------------------------------------------
def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def cmd_data(args) -> int:
    """rollout_only runs of the dense and the MoE recipe (each launches its own CPU SGLang server),
    side by side; keeps each run's rollouts and the HF checkpoint they were sampled from."""
    dest = gpu_common.data_dir()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = {}
    for name, recipe in gpu_common.LOOP_MODELS.items():
        run = dest / f"{name}.run"
        cmd = [sys.executable, "-m", "megatron_rl.cli", "train", recipe, f"trainer.out_dir={run}",
               "trainer.mode=rollout_only", f"trainer.steps={gpu_common.ROLLOUT_STEPS}",
               *gpu_common.LOOP_OVERRIDES]
        log = open(dest / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log, run)
    failed = []
    for name, (proc, log, run) in procs.items():
        rc = proc.wait(timeout=args.timeout)
        log.close()
        if rc:
            failed.append(f"{name}: exit {rc}, log {dest / f'{name}.log'}:\n"
                          + (dest / f"{name}.log").read_text()[-3000:])
            continue
        saved = sorted(p.name for p in (run / "rollouts").iterdir())
        want = [f"step_{s:08d}.dp0.pt" for s in range(gpu_common.ROLLOUT_STEPS)]
        if saved != want:
            failed.append(f"{name}: rollouts {saved}, expected {want}")
            continue
        (dest / name).mkdir()
        shutil.move(str(run / "rollouts"), dest / name / "rollouts")
        shutil.move(str(run / "tiny_model"), dest / name / "tiny_model")
        shutil.copy(run / "config.yaml", dest / name / "rollout_config.yaml")
        shutil.rmtree(run)  # its learner checkpoint and server logs need not travel
        (dest / f"{name}.log").unlink()
    if failed:
        print("\n".join(failed))
        return 1
    from importlib import metadata

    import torch

    manifest = {
        "commit": git_commit(),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "rollout_steps": gpu_common.ROLLOUT_STEPS,
        "loop_overrides": gpu_common.LOOP_OVERRIDES,
        "models": {name: {"recipe": recipe, "hf_path": f"{name}/tiny_model", "rollouts": f"{name}/rollouts"}
                   for name, recipe in gpu_common.LOOP_MODELS.items()},
        "made_with": {"torch": torch.__version__, "sglang": metadata.version("sglang"),
                      "megatron-core": metadata.version("megatron-core"), "python": sys.version.split()[0]},
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"data: {', '.join(gpu_common.LOOP_MODELS)} x {gpu_common.ROLLOUT_STEPS} saved rollout steps in "
          f"{dest} ({size / 2**20:.2f} MiB)")
    return 0


# ---------------------------------------------------------------------------------------------
# imports of the train_only path
# ---------------------------------------------------------------------------------------------
def check_imports(trace: dict, pins: list[Pin]) -> tuple[list[str], dict[str, list[str]]]:
    """Every top-level package that the project's code, or a package travelling as a wheel,
    imported must be the project's, the standard library's (as of 3.12), a wheel's or the image's.
    Imports made inside image packages (transformers, torch, ...) are the image's own business:
    they may differ between this machine's versions and the image's."""
    from importlib.metadata import packages_distributions

    dist_of = packages_distributions()
    wheel_names = {norm(p.name) for p in pins}
    image = read_image()

    def dists(module: str) -> list[str]:
        return [norm(d) for d in dist_of.get(module, [])]

    def travels(module: str) -> bool:
        return any(d in wheel_names for d in dists(module))

    needed: dict[str, set[str]] = {}
    for importer, imported in trace["edges"]:
        if (importer in PROJECT or travels(importer)) and imported != importer:
            needed.setdefault(imported, set()).add(importer)
    problems, where = [], {}
    for module, importers in sorted(needed.items()):
        if module in PROJECT or module not in trace["loaded"]:
            continue
        if module in REMOVED_IN_312:
            problems.append(f"{module} (imported by {sorted(importers)}) is gone from Python 3.12's standard library")
            continue
        if module in sys.stdlib_module_names or module in ("__future__",):
            continue
        found = dists(module)
        home = ("wheel" if any(d in wheel_names for d in found) else
                "image" if any(d in image for d in found) else None)
        if home is None:
            problems.append(f"{module} (distribution {found or '?'}, imported by {sorted(importers)}) is "
                            "neither in tests/gpu/wheels.txt nor in the image")
        else:
            where.setdefault(home, []).append(module)
    return problems, where


# ---------------------------------------------------------------------------------------------
# size of what travels
# ---------------------------------------------------------------------------------------------
def travelling_bytes(gpu_dir: Path) -> dict[str, int]:
    """The working tree's tracked + untracked-not-ignored files (what the GPU machine receives
    besides carried folders) and the carried gpu dir."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    tree = sum(os.lstat(REPO / f).st_size for f in listed if f and os.path.lexists(REPO / f))
    carried = sum(p.lstat().st_size for p in gpu_dir.rglob("*") if p.is_file() or p.is_symlink()) \
        if gpu_dir.exists() else 0
    return {"working_tree": tree, "gpu_dir": carried, "total": tree + carried}


def cmd_size(args) -> int:
    sizes = travelling_bytes(gpu_common.gpu_dir())
    mib = {k: v / 2**20 for k, v in sizes.items()}
    print(f"travels: working tree {mib['working_tree']:.2f} MiB + {gpu_common.gpu_dir()} "
          f"{mib['gpu_dir']:.2f} MiB = {mib['total']:.2f} MiB (limit {LIMIT_MIB} MiB)")
    return 0 if sizes["total"] < LIMIT_MIB * 2**20 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels")
    w.add_argument("--check-only", action="store_true", help="check the list, download nothing")
    w.add_argument("--record", action="store_true", help="rewrite tests/gpu/wheel-requirements.json")
    d = sub.add_parser("data")
    d.add_argument("--timeout", type=float, default=900)
    sub.add_parser("size")
    args = p.parse_args(argv)
    return {"wheels": cmd_wheels, "data": cmd_data, "size": cmd_size}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
