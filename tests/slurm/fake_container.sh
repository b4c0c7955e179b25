#!/usr/bin/env bash
# CONTAINER_EXEC / ROLLOUT_CONTAINER_EXEC for the launcher tests (tests/slurm/test_sbatch.py): runs
# the command as a container runtime would, with the "image's" bin/ first on PATH. Its python3 logs
# each call (role, CUDA_DEVICE_MAX_CONNECTIONS as the process sees it) to $CONTAINER_LOG and runs
# contract_python.sh.
export PATH="$(cd "$(dirname "$0")" && pwd)/container_bin:$PATH"
exec "$@"
