#!/usr/bin/env bash
# PYTHON for the sbatch script in the launcher-contract tests (tests/slurm/test_sbatch.py):
# the rank command (`-m megatron_rl.cli train-lm ...`) runs contract_rank.py; everything else,
# dry-run and SGLang servers included, runs the real interpreter $REAL_PYTHON. The supervised
# recipe has no rollout group, so `rollout.server_urls=...` is dropped from its dry-run.
if [[ ${1:-} == -m && ${2:-} == megatron_rl.cli && ${3:-} == train-lm ]]; then
    exec "$REAL_PYTHON" "$(dirname "$0")/contract_rank.py" "${@:4}"
fi
if [[ ${1:-} == -m && ${2:-} == megatron_rl.cli && ${3:-} == dry-run ]]; then
    args=()
    for a in "$@"; do [[ $a == rollout.server_urls=* ]] || args+=("$a"); done
    exec "$REAL_PYTHON" "${args[@]}"
fi
exec "$REAL_PYTHON" "$@"
