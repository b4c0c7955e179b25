"""Start one SGLang server with this project's SGLang patches applied in every server process.

    python -m megatron_rl.rollout.launch_server --model-path CKPT --device cpu --dtype float32 ...

takes SGLang's own server arguments and runs SGLang's HTTP server entry point
(`sglang.launch_server`) with them. It applies `patches.sglang_fixes` (every device) and, with
`--device cpu`, first `patches.sglang_cpu`.

`MRL_SGLANG_API_KEY` in the environment becomes SGLang's `api_key` (rollout/auth.py): every request
but the health probes must then carry it.

`--exit-with-parent` (EngineManager's servers): the server shuts down once the process that started
it is gone.

`--slurm-slot` (the sbatch script's disaggregated servers, several per node in one srun step):
this process is server k = SLURM_LOCALID of its node. It serves on the node's GPUs
[k·TP, (k+1)·TP) (of CUDA_VISIBLE_DEVICES when Slurm set it; CUDA_VISIBLE_DEVICES is narrowed to
them before anything touches CUDA) and on port PORT + k·16 (`--port` is the node's base port);
rollout/placement.py's `slot_on_node` is the rule, and the dry-run prints the same layout.

Why a launcher module: SGLang runs its scheduler and detokenizer in children started with
multiprocessing's *spawn*, which re-imports the parent's `__main__` module (as `__mp_main__`)
in each child before unpickling anything. Applying the patches at this module's import time is
therefore what puts them in the children too; `SGLANG_USE_CPU_ENGINE=1`, set here and inherited
through the environment, tells each child that it serves on CPU.
"""

from __future__ import annotations

import os
import signal
import sys


def _device(argv: list[str]) -> str | None:
    from megatron_rl.rollout.placement import flag_value  # no torch at import: safe before CUDA

    return flag_value(argv, ("--device",))


def apply_patches() -> None:
    """Apply the SGLang patches this process needs: the CPU layer when serving on CPU, then the
    fixes every server needs."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        from patches import sglang_cpu

        sglang_cpu.apply()
    from patches import sglang_fixes

    sglang_fixes.apply()


if __name__ == "__main__":
    # Before the patches import SGLang (and torch): the GPUs must be chosen before CUDA starts.
    from megatron_rl.rollout.placement import take_slurm_slot

    sys.argv[1:] = take_slurm_slot(sys.argv[1:])
    if _device(sys.argv[1:]) == "cpu":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
# Runs in the launching process and, through spawn's re-import of __main__, in every child.
apply_patches()
# SIGUSR1 is the learner's preemption signal (Slurm's --signal, `scancel -s USR1`), and srun
# delivers it to every process of the step, servers started by rank 0 included. The trainer
# finishes its step, checkpoints and then stops its servers itself; a server killed by the
# signal (Python's default action) would fail that last step's weight sync.
signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _add_versions_route() -> None:
    """GET /megatron_rl/versions: this server's torch, NCCL and SGLang, which the trainer compares with
    its own before the weight-update group forms (weights/endpoint.py `check_nccl`)."""
    import sglang
    import torch
    from sglang.srt.entrypoints.http_server import app

    from megatron_rl.weights.endpoint import VERSIONS_ROUTE, nccl_version

    versions = {"torch": torch.__version__, "nccl": nccl_version(), "sglang": sglang.__version__}

    @app.get(VERSIONS_ROUTE)
    async def _versions() -> dict:
        return versions


def main(argv: list[str] | None = None) -> None:
    from megatron_rl.rollout.placement import quiet_http  # no torch at import: safe before CUDA

    argv = quiet_http(sys.argv[1:] if argv is None else argv)
    if "--exit-with-parent" in argv:
        argv = [a for a in argv if a != "--exit-with-parent"]
        from megatron_rl.rollout.lifeline import exit_with_parent

        exit_with_parent()
    if _device(argv) == "cpu" and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        apply_patches()
    # Same steps as `python -m sglang.launch_server` (sglang 0.5.23's __main__ block).
    if _device(argv) == "cpu":
        from patches import sglang_cpu

        argv = sglang_cpu.deterministic_server_argv(argv)
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    from megatron_rl.rollout.auth import ENV

    if os.environ.get(ENV) and not server_args.api_key:  # the job's key: from the environment, never argv
        server_args.api_key = os.environ[ENV]
    _add_versions_route()
    # A server started by hand (or by the sbatch) asks itself at start-up: never through a proxy.
    from megatron_rl.rollout.direct import direct_env

    os.environ.update(direct_env(os.environ, [server_args.host]))
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
