"""Run a function on N local gloo processes and collect each rank's return value.

Used by the multi-process tests and the CPU benchmarks: real collectives over gloo, never stubs.
`fn(rank, world_size, *args)` runs after `torch.distributed.init_process_group("gloo")`; its
return value (anything picklable; tensors are fine) comes back in rank order. An exception on any
rank is re-raised in the caller with that rank's traceback.

On a machine without CUDA, ranks start from a fork server (multiprocessing's "forkserver"), one per
calling process, that has imported torch, megatron-core, mbridge and transformers once (`PRELOAD`):
a rank starts in a fraction of a second instead of importing them again (about 5 s of CPU per rank
on a 2-core machine). Each rank is a fresh fork of that server, never of the caller, so nothing of
the caller's state (threads, process groups, patches applied) leaks into it; it takes the caller's
current environment, working directory, sys.path, stdout and stderr (the file descriptors, passed to
it), as a spawned process would. `tests/distributed` on two pytest-xdist workers: 221 s with spawned
ranks, 67 s with forked ones.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


EXIT_GRACE_S = 30.0
# Imported once by the fork server; not patched there (each rank applies the project's patches itself,
# as a spawned rank did), and none starts a thread or touches a device at import.
PRELOAD = ("torch", "torch.distributed", "megatron.core", "mbridge", "transformers")
_ctx = None


def context():
    """The forkserver context, its preload set on first use (the server starts with the first rank).
    Where CUDA is present, spawn as before: a module that asks for the device count at import starts
    the CUDA driver in the fork server, and CUDA does not survive a fork."""
    global _ctx
    if _ctx is None:
        if torch.cuda.is_available():
            _ctx = mp.get_context("spawn")
        else:
            import importlib.util

            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload([m for m in PRELOAD if importlib.util.find_spec(m.split(".")[0])])
            _ctx = ctx
    return _ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Fd:
    """The caller's file descriptor `fd`, sent to the rank as it starts (the fork server's own stdout and
    stderr are those of the caller's first rank: pytest's capture of another test, say)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # pickled while the rank starts: the fd travels with it
        from multiprocessing import reduction

        return _Fd._received, (reduction.DupFd(self.fd),)

    @staticmethod
    def _received(dup) -> int:
        return dup.detach()


def _stdio() -> tuple[_Fd, _Fd] | None:
    """This process's stdout and stderr for a forked rank, when both are open (a daemon may have
    neither). A spawned rank inherits them."""
    if context().get_start_method() != "forkserver":
        return None
    try:
        os.fstat(1), os.fstat(2)
    except OSError:
        return None
    return _Fd(1), _Fd(2)


def _take_stdio(fds: tuple[int, int]) -> None:
    import sys

    for stream, target, fd in ((sys.stdout, 1, fds[0]), (sys.stderr, 2, fds[1])):
        if fd != target:
            stream.flush()
            os.dup2(fd, target)
            os.close(fd)


def _as_caller(environ: dict[str, str], stdio: tuple[int, int] | None, target: Callable, *args) -> None:
    """In the new process: take the caller's environment and output, then run target(*args)."""
    if stdio is not None:
        _take_stdio(stdio)
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(environ)
    if environ.get("OMP_NUM_THREADS", "").isdigit():  # read by the OpenMP runtime when torch was imported
        torch.set_num_threads(max(1, int(environ["OMP_NUM_THREADS"])))
    target(*args)


def process(target: Callable, *args: Any):
    """An unstarted process running target(*args) as a spawned one would (module-level `target`):
    forked from the fork server without CUDA, spawned with it. Its queues: `context().Queue()`."""
    return context().Process(target=_as_caller, args=(dict(os.environ), _stdio(), target, *args), daemon=False)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        except Exception as e:  # DistNetworkError: the probed port was taken before the bind
            if "EADDRINUSE" in str(e):
                queue.put((rank, "port", traceback.format_exc()))
                return
            raise
        result = fn(rank, world_size, *args)
        dist.barrier()  # no rank tears down while a peer still runs collectives
        # Serialise with torch.save: tensors sent through the queue as-is would be shared-memory
        # handles that die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report every failure, including SystemExit from a bad config
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 900.0,
                    attempts: int = 3) -> list[Any]:
    """Spawn `world_size` gloo processes running `fn(rank, world_size, *args)`; return results by rank.

    `fn` must be importable by name (a module-level function) because processes are spawned. The
    port is probed free here and bound by rank 0's store moments later; another process on the
    machine can take it in between. Rank 0 then fails to bind before `fn` has run, and the run is
    started again on a new port (up to `attempts` times).
    """
    for attempt in range(attempts):
        try:
            return _run_once(fn, world_size, args, timeout)
        except _PortTaken:
            if attempt == attempts - 1:
                raise RuntimeError(f"distributed run failed: {attempts} ports taken before rank 0 bound them")
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    queue = context().Queue()
    port = 0 if world_size == 1 else free_port()  # a group of one: its store binds any free port
    procs = [process(_worker, r, world_size, port, fn, args, queue) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    port_taken = False
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if dead:
                errors.append(f"ranks {dead} died without a report (exit codes "
                              f"{[procs[r].exitcode for r in dead]})")
            elif time.monotonic() > deadline:
                errors.append(f"timed out after {timeout:.0f}s; finished ranks: {sorted(results)}")
            continue
        if ok == "port":
            errors.append(payload)
            port_taken = True
        elif ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")  # peers may block in a collective
    # Every rank has reported (or one failed): give the workers a grace period to exit, then
    # stop them. A worker that reported its result but hangs in interpreter shutdown (e.g. a
    # side process group's teardown) is not a failure of the run.
    for p in procs:
        p.join(timeout=0 if port_taken else 5 if errors else EXIT_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
    if port_taken:
        raise _PortTaken()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
