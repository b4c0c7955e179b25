"""Fault injection for tests/slurm/test_sbatch.py: on the job's PYTHONPATH, so every process of the
job imports it; it acts only in the process that pushes weights (learner rank 0 of the attempt named).

MRL_TEST_KILL_SERVER_AT=A:P -- in attempt A (SLURM_RESTART_COUNT), during weight push P of the
attempt (1: the push before its first step), every rollout server this rank started is killed
(SIGKILL, each server's whole process tree) after the servers have been asked to receive the first
bucket and before it is broadcast: a server lost in the middle of a push, as an out-of-memory kill
or a lost node leaves it.
"""

import importlib.abc
import importlib.machinery
import os
import sys

MODULE = "megatron_rl.weights.sync_distributed"


def _armed() -> bool:
    spec = os.environ.get("MRL_TEST_KILL_SERVER_AT", "")
    if not spec or os.environ.get("SLURM_PROCID") != "0":
        return False
    return os.environ.get("SLURM_RESTART_COUNT", "0") == spec.split(":")[0]


def _kill_servers() -> None:
    import signal

    import psutil

    me = psutil.Process()
    roots = [p for p in me.children() if "megatron_rl.rollout.launch_server" in " ".join(p.cmdline())]
    assert roots, "fault injection: this rank started no rollout server"
    for root in roots:
        for p in root.children(recursive=True) + [root]:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        root.wait(30)
    print(f"[fault injection] killed {len(roots)} rollout server(s) during a weight push", flush=True)


def _patch(module) -> None:
    target = int(os.environ["MRL_TEST_KILL_SERVER_AT"].split(":")[1])
    pushes = [0]
    push = module.DistributedWeightSync.push

    def counted_push(self, *args, **kwargs):
        pushes[0] += 1
        return push(self, *args, **kwargs)

    real = module.dist

    class Dist:  # the module's torch.distributed, whose broadcast is preceded by the kill once
        def __getattr__(self, name):
            return getattr(real, name)

        def broadcast(self, *args, **kwargs):
            if pushes[0] == target:
                pushes[0] = -1  # once
                _kill_servers()
            return real.broadcast(*args, **kwargs)

    module.DistributedWeightSync.push = counted_push
    module.dist = Dist()


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _armed():
    sys.meta_path.insert(0, _AfterImport())
