#!/usr/bin/env bash
# `make gpu-env-check`: requirements/gpu-lock.txt installed for real on a Linux x86_64 host, no GPU
# needed, by the image's own install script: `docker/install_lock.sh VENV base project`, what the
# default image installs (no Transformer Engine: TE's core wheels without its torch extension break
# `import megatron.core`, docs/cluster.md). Then docker/verify_env.py, the image build's verify step,
# and a tiny Megatron model built and trained for 3 steps on CPU with each CPU-capable layer spec
# (`megatron-rl train-lm tiny_lm_cpu model.spec=torch|local`). docs/cluster.md has a run's figures.
#
# Without a GPU driver, sgl-flash-mla's library cannot load (it links libcuda.so.1) and raises
# OSError, which megatron-core's `try: import flash_mla / except ImportError` does not catch: no
# model builds. So on such a host the training step runs with a flash_mla that raises ImportError
# instead (a one-line module on PYTHONPATH, made here), as megatron-core expects of a missing one.
#
#   GPU_CHECK_VENV  the venv (default /tmp/megatron-rl-gpu-check; made afresh each run, ~11 GB)
#   GPU_PYTHON      a Python 3.12, the lock's (default python3.12)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${GPU_CHECK_VENV:-/tmp/megatron-rl-gpu-check}
PYTHON=${GPU_PYTHON:-python3.12}
say() { echo "gpu-env-check: $*"; }

if [ "$(uname -m)" != x86_64 ]; then
    say "the lock is for Linux x86_64; this machine is $(uname -m)"
    exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    say "GPU_PYTHON=$PYTHON is not a Python 3.12 (the lock's); name one: make gpu-env-check GPU_PYTHON=..."
    exit 1
fi
if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
    say "GPU_CHECK_VENV=$VENV exists and is not a venv; not removing it"
    exit 1
fi

start=$SECONDS
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
docker/install_lock.sh "$VENV" base project
say "installed in $((SECONDS - start)) s; the venv holds $(du -sh "$VENV" | cut -f1)"

"$VENV/bin/python" docker/verify_env.py

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
shims=
if ! "$VENV/bin/python" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>/dev/null; then
    mkdir -p "$scratch/shims/flash_mla"
    echo 'raise ImportError("flash_mla: its library links libcuda.so.1; no GPU driver here (.ci/gpu_env_check.sh)")' \
        > "$scratch/shims/flash_mla/__init__.py"
    shims=$scratch/shims
    say "no GPU driver: training with flash_mla raising ImportError (see the script's header)"
fi
for spec in torch local; do
    MRL_RUNS=$scratch/runs PYTHONPATH=$shims "$VENV/bin/megatron-rl" train-lm tiny_lm_cpu model.spec=$spec \
        train.steps=3 train.log_every=1 "train.out_dir=$scratch/runs/$spec"
done
say "passed in $((SECONDS - start)) s"
