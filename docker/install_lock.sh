#!/usr/bin/env bash
# Install requirements/gpu-lock.txt into a venv, hash-checked, in the parts the image's two stages
# need. The one copy of the GPU environment's pip commands: docker/Dockerfile.gpu (both stages),
# `make gpu-env` and `make gpu-env-check` (.ci/gpu_env_check.sh) call it, and
# tests/unit/test_gpu_install_commands.py holds them to that.
#
#   docker/install_lock.sh VENV base      setuptools + wheel, then every pin but Transformer Engine's
#                                         three (wheels, and antlr4-python3-runtime's sdist: no compiler)
#   docker/install_lock.sh VENV te        transformer-engine and transformer-engine-cu13 (wheels), then
#                                         transformer-engine-torch built from its sdist (not without
#                                         the others: TE's core without its torch extension breaks
#                                         `import megatron.core`, docs/cluster.md)
#   docker/install_lock.sh VENV project   this repository, editable, without dependencies
#
# Every file is checked against the lock's hashes, and --no-deps: the lock is the whole set. In steps
# because pip builds an sdist before it installs anything: setuptools + wheel first, so that the
# sdists can be built with --no-build-isolation against what is installed. transformer-engine-torch
# is a C++ torch extension (g++, no CUDA code: no nvcc compile, no GPU architectures): it needs torch
# installed, python3-dev, g++, the CUDA headers (CUDA_HOME/include, else nvcc's, else
# /usr/local/cuda's), an nvcc its setup.py asks for the CUDA version, and the NCCL and cuDNN headers,
# taken here from the lock's wheels. NVTE_PYTORCH_FORCE_BUILD stops that setup.py fetching a prebuilt
# wheel from GitHub, which no hash covers. MAX_JOBS: parallel compiles (default 8).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 VENV base|te|project..." >&2
    exit 2
fi
VENV=$1
shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LOCK=$REPO/requirements/gpu-lock.txt
PIP=("$VENV/bin/python" -m pip install --require-hashes --no-deps)

# The lock's split (extended regular expressions on a pin line, `name==version`).
BUILD='^(setuptools|wheel)=='
TE_CORE='^(transformer-engine|transformer-engine-cu13)=='
TE_TORCH='^transformer-engine-torch=='
NOT_BASE='^(setuptools|wheel|transformer-engine|transformer-engine-cu13|transformer-engine-torch)=='

SPLIT=$(mktemp -d)
trap 'rm -rf "$SPLIT"' EXIT

# pick ERE KEEP NAME: the lock's entries (a pin line and its hash lines) whose pin matches ERE
# (KEEP=1) or does not (KEEP=0), into $SPLIT/NAME.txt; fails when that is no pin at all.
pick() {
    awk -v pick="$1" -v keep="$2" '/^[^ #]/ { hit = ($0 ~ pick) } hit == keep' "$LOCK" > "$SPLIT/$3.txt"
    if ! grep -q '^[^ #]' "$SPLIT/$3.txt"; then
        echo "install_lock.sh: no pin of $LOCK matches the $3 part ($1)" >&2
        exit 1
    fi
}

for part in "$@"; do
    case $part in
        base)
            pick "$BUILD" 1 build
            pick "$NOT_BASE" 0 main
            "${PIP[@]}" -r "$SPLIT/build.txt"
            "${PIP[@]}" --no-build-isolation -r "$SPLIT/main.txt"
            ;;
        te)
            pick "$TE_CORE" 1 te-core
            pick "$TE_TORCH" 1 te-torch
            "${PIP[@]}" -r "$SPLIT/te-core.txt"
            # nccl.h and cudnn.h: those of the NCCL and cuDNN wheels torch loads, before any system copy.
            site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
            CPATH="$site/nvidia/nccl/include:$site/nvidia/cudnn/include${CPATH:+:$CPATH}" \
                NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-8} \
                "${PIP[@]}" --no-build-isolation -r "$SPLIT/te-torch.txt"
            ;;
        project)
            "$VENV/bin/python" -m pip install --no-deps --no-build-isolation -e "$REPO"
            ;;
        *)
            echo "install_lock.sh: unknown part '$part' (valid: base, te, project)" >&2
            exit 2
            ;;
    esac
done
