"""Checkpoints with exact resume, on megatron-core's dist_checkpointing.

A checkpoint is a folder `<out_dir>/checkpoints/step_<N>` holding
- the model chunks and the optimizer (Adam moments, fp32 master weights, step counts) as sharded
  tensors (`dist_checkpointing.save`, torch_dist format: every rank writes its own shards, and a
  checkpoint written at one parallel layout loads at another),
- the LR scheduler and the trainer state (step, prompt-stream position, weight version) as common
  state written once,
- every rank's RNG states (python, torch, Megatron's model-parallel tracker) in `rng/rank<r>.pt`,
  so dropout and sampling continue bit for bit;
- other trained models of the run (the PPO critic) in a sub-folder each, `<name>/`, with their
  own model, optimizer and LR scheduler state.
It is written to `step_<N>.tmp` and renamed only when every rank has finished; the file `latest`
is then replaced atomically: written to `latest.tmp`, fsynced, renamed, and the folder fsynced after
each rename (the checkpoint's and the marker's), so that a crash (of the node, not only of the
process) leaves `latest` naming a complete checkpoint, never empty. A crash mid-write therefore leaves
the previous checkpoint intact, and `latest_checkpoint` never returns a partial one. Older
checkpoints beyond `keep` are removed; `.tmp` folders a crashed or killed job left behind (a 30B
one is up to 427 GB) are removed when the next `Checkpointer` of the run starts (`remove_abandoned`).

**Who writes what.** Dist-checkpointing writes each tensor once, from the rank holding its main
replica, and that rank stages it in host memory for an asynchronous save. Megatron-core marks data-
parallel rank 0's copy as the main replica (expert-data-parallel rank 0 for experts), so at 30B-A3B
(TP 2, EP 8, expert-DP 4, the distributed optimizer: docs/slurm.md) node 0 alone would stage every
bf16 expert weight, 58 GB on top of its own 92 GB of optimizer shards: 153 GB of host memory, where a
spread save stages 107 GB on every node (`benchmarks/bench_checkpoint.py` prints the arithmetic).
The save is spread instead (megatron-core's `FullyParallelSaveStrategyWrapper`, what Megatron-LM's
`--ckpt-fully-parallel-save` does): the ranks exchange which shards each holds (metadata only, no
tensor moves) and every replicated shard goes to the least loaded rank that holds a replica, by
bytes, the same decision on every rank. The group is the data-parallel one, which holds every
replica of a dense shard and, where `tp` divides `etp x ep` (configs/parallel/h100_moe_4node.yaml:
TP 2, EP 8, expert TP 1), every replica of an expert one (the expert-data-parallel group lies
inside it); where it does not (e.g. TP 2, EP 1, expert TP 1), the whole world, so that no replica
is left out. The files are the same torch_dist checkpoint as before, and load at any layout.
The load is not spread (megatron-core's `FullyParallelLoadStrategyWrapper`): it would read each shard
once and broadcast it over the data-parallel group in CUDA buffers of every shard, which the CPU path
has not and a 30B resume, once per job, does not need; each rank reads what it holds.

`Checkpointer` writes them, synchronously or (`trainer.async_save`) while training goes on, and ends
every rank within seconds, naming the rank, when a save fails on any one of them (see there).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import multiprocessing as mp
import os
import queue
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.distributed.parent import die_with_parent

PREFIX = "step_"


def checkpoints_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under out_dir, or None."""
    root = checkpoints_root(out_dir)
    marker = root / "latest"
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{marker} names {path.name}, which does not exist")
    return path


def _size(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def checkpoint_bytes(params: int, dtype: str) -> int:
    """One checkpoint of a model with `params` parameters trained in `dtype`: bf16 / fp16 weights (2 bytes)
    + fp32 main weights (4) + Adam's two fp32 moments (8) = 14 bytes per parameter; fp32: 4 + 8 = 12."""
    return params * (12 if dtype in ("float32", "fp32") else 14)


def storage_check(job, free_bytes: Callable[[Path], int] = lambda p: shutil.disk_usage(p).free,
                  home: Optional[str] = None) -> tuple[str, list[str]]:
    """What the run's checkpoints need on disk, said before a launch: (a line for the dry-run, the
    problems that refuse it). `keep_checkpoints` are kept and one more is written before the oldest
    goes, so keep + 1 must fit in the free space of the run folder's file system. A run meant for GPUs
    (`hardware` other than cpu) may not keep multi-GB checkpoints under $HOME (usually a quota'd NFS
    shared by the cluster): RUN_DIR / trainer.out_dir on the parallel file system, or
    MRL_ALLOW_HOME_RUN_DIR=1."""
    from megatron_rl.models.layout import parameter_count

    params = parameter_count(job.model)
    if params is None:
        return "checkpoints: size unknown until the model's config.json exists", []
    on_cpu = job.hardware.lower().startswith("cpu")  # the recipes' `hardware`: "cpu: ..." or "N nodes x 8 H100 ..."
    dtype = job.model.dtype if job.model.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
    models = 2 if job.algorithm.advantage == "gae" else 1  # the critic: a second trunk of about the same size
    one = checkpoint_bytes(params, dtype) * models
    keep = max(1, job.trainer.keep_checkpoints)
    need = one * (keep + 1)
    out = Path(job.trainer.out_dir).expanduser().resolve()
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = free_bytes(probe)
    line = (f"checkpoints: {_size(one)} each ({params / 1e6:,.1f}M params x {one // (params * models)} bytes"
            f"{', policy + critic' if models == 2 else ''}); keep_checkpoints={keep} + 1 being written = "
            f"{_size(need)}; {_size(free)} free on {probe}")
    problems = []
    if need > free:
        problems.append(f"the run folder {out} has {_size(free)} free and its checkpoints need "
                        f"{_size(need)} (keep_checkpoints={keep} + 1 being written): free space, lower "
                        "trainer.keep_checkpoints, or put RUN_DIR / trainer.out_dir elsewhere")
    home = home if home is not None else os.environ.get("HOME")
    if (not on_cpu and home and one > 10e9 and not os.environ.get("MRL_ALLOW_HOME_RUN_DIR")
            and out.is_relative_to(Path(home).resolve())):
        problems.append(f"the run folder {out} is under $HOME ({home}), usually a quota'd shared file system, and "
                        f"each checkpoint is {one / 1e9:,.0f} GB: give RUN_DIR (or trainer.out_dir) on the cluster's "
                        "parallel file system, or set MRL_ALLOW_HOME_RUN_DIR=1")
    return line, problems


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def model_sharded_state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """The model part of a checkpoint: {"model<i>": sharded state dict of this rank's chunk i}.

    The `model<i>` names only nest the request; what is stored are megatron-core's sharded keys,
    which name layers by their global number (transformer_block.py) and experts by their global
    index, and record each tensor's global shape. So the model part of a checkpoint written at one
    TP / PP / VPP / EP layout loads into the chunks of any other (`load_model_weights`).
    `chunks`: GPTModels (or the Float16Module around one), one per virtual pipeline stage.
    """
    from megatron.core import parallel_state as mpu

    state: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        if len(chunks) > 1:
            mpu.set_virtual_pipeline_model_parallel_rank(i)
        state[f"model{i}"] = chunk.sharded_state_dict()
    if len(chunks) > 1:
        mpu.set_virtual_pipeline_model_parallel_rank(0)
    return state


def _sharded_state(learner, is_loading: bool) -> dict[str, Any]:
    state = model_sharded_state([chunk.module for chunk in learner.model])
    model_state = {k: v for k, v in state.items()}
    state["optimizer"] = learner.optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    return state


def _load_learner(learner, folder: Path, with_trainer_state: bool = False) -> Optional[dict[str, Any]]:
    from megatron.core import dist_checkpointing

    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {folder.parent} has no {folder.name}/ (was it written by a "
                                f"run without that model?)")
    state = _sharded_state(learner, is_loading=True)
    state["scheduler"] = None
    if with_trainer_state:
        state["trainer"] = None
    loaded = dist_checkpointing.load(state, str(folder))
    for i, chunk in enumerate(learner.model):
        chunk.module.load_state_dict(loaded[f"model{i}"])
    learner.optimizer.load_state_dict(loaded["optimizer"])
    learner.scheduler.load_state_dict(loaded["scheduler"])
    return loaded.get("trainer")


def load_model_weights(chunks: list[torch.nn.Module], path: str | Path) -> None:
    """Collective: only the model weights of checkpoint `path` (no optimizer, scheduler or RNG
    state) into `chunks`, at this process's layout, whatever layout wrote it."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a megatron-rl checkpoint (no metadata.json; checkpoints are "
                                f"<run>/checkpoints/{PREFIX}<N>)")
    loaded = dist_checkpointing.load(model_sharded_state(chunks), str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"])


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, on this rank or another (named in the message)."""


class _WriteFailed(OSError):
    """This rank's shard writer reported an error (its text: the writer's exception)."""


@dataclasses.dataclass
class _Save:
    """A save whose shards are being written (by a writer process, or inline)."""

    step: int
    tmp: Path
    final: Path
    requests: list  # megatron-core AsyncRequests: the policy's, then each other model's
    started: float  # time.monotonic() when the save was asked for
    blocked_s: float  # seconds the caller was held up so far
    waited_s: float = 0.0  # of blocked_s: the wait for the previous save to finish
    process: Optional[Any] = None  # the forked writer (asynchronous saves)
    forked_at: float = 0.0  # time.monotonic() when the writer was forked
    done_at: Optional[Any] = None  # the writer's time.monotonic() when its shards were on disk (shared memory)
    written_s: Optional[float] = None  # seconds from the start until this rank's shards were on disk (seen)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync(path: Path) -> None:
    """What was written to `path` (a file, or a folder's entries: a rename in it) is on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tree_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def spread_group(ctx, experts: bool) -> Optional[dist.ProcessGroup]:
    """Collective: the group a save is spread over (module docstring, "Who writes what"): the
    data-parallel group when the model has no experts or it holds every expert-data-parallel peer of
    every rank, else the whole world (decided alike on every rank); None for one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if not experts:
        return ctx.dp_group
    inside = set(dist.get_process_group_ranks(ctx.expert_dp_group)) <= set(dist.get_process_group_ranks(ctx.dp_group))
    outside = torch.tensor([0 if inside else 1], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(outside, op=dist.ReduceOp.MAX)
    return dist.group.WORLD if int(outside[0]) else ctx.dp_group


def _save_strategy(group: Optional[dist.ProcessGroup]):
    """torch_dist (megatron-core's default), spread over `group` when there is one."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy("torch_dist")
    # Not cached (do_cache_distribution): a shard missing from a cached plan would be written by nobody.
    return strategy if group is None else FullyParallelSaveStrategyWrapper(strategy, group)


def _write_shards(requests: list) -> None:
    """This rank's shard files of every request (megatron-core's writer, its own worker processes):
    in a forked writer process for an asynchronous save, inline for a synchronous one. The outcome
    goes to each request's results queue."""
    for req in requests:
        if req.async_fn is not None:
            req.async_fn(*req.async_fn_args, **req.async_fn_kwargs)


def _forked_writer(requests: list, done_at, parent_pid: int) -> None:
    # Dies with its rank: a rank killed mid-save (out of memory, SIGKILL) must not leave a writer that
    # goes on filling step_N.tmp while the requeued attempt clears it and saves step N there anew.
    # Forked by the loop's thread, which lives as long as the rank.
    die_with_parent(parent_pid)
    gc.disable()  # a collection in the fork could free the parent's CUDA tensors (megatron-core does the same)
    _write_shards(requests)
    done_at.value = time.monotonic()  # CLOCK_MONOTONIC: the same clock as the parent's


def _staged(req):
    """`req` with its tensors staged in host memory (GPU -> CPU copies; CPU tensors as they are, which a
    forked writer sees as they were at the fork)."""
    if req.preload_fn is None:
        return req
    args = list(req.async_fn_args)
    args[1] = req.preload_fn()
    return req._replace(async_fn_args=tuple(args), preload_fn=None)


def _write_result(req, writer) -> Optional[str]:
    """What went wrong with this rank's write of `req` (None: nothing). The result stays in the queue
    for megatron-core's finalization, which reads it again."""
    if req.async_fn is None:
        return None
    results = req.async_fn_args[2]
    try:
        result = results.get(timeout=30 if writer is not None else 0.1)
    except queue.Empty:
        code = writer.exitcode if writer is not None else None
        return f"the shard writer left no result (writer process exit code {code})"
    results.put(result)
    if isinstance(result, BaseException):
        return f"{type(result).__name__}: {result}"
    return None


class Checkpointer:
    """Collective: every learner rank makes the same calls in the same order.

    `save` writes a checkpoint (the layout in the module docstring) into `step_<N>.tmp`; it becomes
    `step_<N>` and `latest` only once every rank's shards are on disk, so the previous checkpoint stays
    the one a resume finds until then. With `async_save`, `save` returns once the shards are staged in
    host memory (GPU -> CPU copies; nothing to copy on CPU) and a forked writer process writes them
    while training goes on; `poll()` (at every step boundary) finishes a save whose writers are all
    done, and `wait()` finishes one whatever it takes (before the next save and before exiting).
    Megatron-core's own asynchronous save path (`dist_checkpointing.save(async_sharded_save=True)`)
    plans and finalizes it; what this class adds is the order of the files and how a failure ends.

    **A failure on any rank ends every rank within seconds, naming it.** The ranks are often inside
    a collective when one of them fails (its peers wait in the all-reduce that asks whether every
    writer is done, or in megatron-core's gathers), and would sit there until the process group's
    timeout (30 minutes). The failing rank posts its error on the c10d store (one key, `<name>/failed`:
    a watcher reads one key per second, whatever the number of ranks) and raises CheckpointError. A
    failed write reaches the others through the all-reduce that asks whether every writer is done,
    and they raise naming it; a watcher thread, running while a save is in progress, ends a rank that
    is stuck in a collective (after `grace_s`, so that one about to raise does so itself) with a line
    naming the failed rank and its error. Because the c10d store lives on global rank 0, its
    disappearance counts as rank 0's failure.
    """

    def __init__(self, out_dir: str | Path, keep: int = 2, async_save: bool = False,
                 device: torch.device | str = "cpu", grace_s: float = 5.0, name: str = "checkpoint",
                 log: Callable[[str], None] = print):
        self.root = checkpoints_root(out_dir)
        self.keep, self.async_save, self.device = keep, bool(async_save), torch.device(device)
        self.grace_s = float(grace_s)
        self.log = log
        distributed = dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1
        self.pending: Optional[_Save] = None
        # The last finished save (seconds): blocked_s (the caller held up, waited_s of it for the save
        # before), writer_s (the forked writer after `save` returned, the slowest rank's; 0 for a
        # synchronous save, whose write is in blocked_s), written_s, total_s (until published).
        self.last: dict[str, float] = {}
        self.recent: collections.deque[dict[str, float]] = collections.deque(maxlen=3)  # the last saves' `last`
        self.blocked_total_s = 0.0  # seconds the callers were held up by saves, all saves together
        self._failed_key = f"{name}/failed"  # "<rank>\n<error>" of the first rank to post one
        self._store = self._watch_store = None  # connections of their own: this thread's, the watcher's
        if self.world > 1:
            from megatron_rl.distributed.wait import _checked_store

            self._store = _checked_store("Checkpointer", None)
            self._watch_store = _checked_store("Checkpointer", None)
        self._watching: Optional[threading.Event] = None
        if self.rank == 0:
            self.remove_abandoned()

    def remove_abandoned(self) -> list[tuple[str, int]]:
        """Rank 0, before this Checkpointer's first save: remove the `step_*.tmp` folders and
        `latest.tmp` that a job which crashed or was killed mid-save left (a 30B one is up to 427 GB,
        and would stay until that very step is saved again), saying what and how big. Nothing writes
        into them: this job's writers are forked by `save` only, and an earlier job's ended with it
        (a requeued job starts after the old one's processes are gone). Returns [(name, bytes)]."""
        removed = []
        for path in sorted(self.root.glob(f"{PREFIX}*.tmp")) + [self.root / "latest.tmp"]:
            if not os.path.lexists(path):
                continue
            size = _tree_bytes(path) if path.is_dir() else os.lstat(path).st_size
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append((path.name, size))
        if removed:
            self.log(f"[megatron-rl] removed what an unfinished save left in {self.root}: "
                     + ", ".join(f"{name} ({_size(size)})" for name, size in removed))
        return removed

    # -- the save --------------------------------------------------------------------------------
    def save(self, learner, step: int, trainer_state: dict[str, Any], others: Optional[dict[str, Any]] = None,
             extra: Optional[Callable[[Path], None]] = None) -> Path:
        """Start (asynchronous) or write (synchronous) the checkpoint of `step`. `others`: {name:
        learner} saved in `<name>/`. `extra(folder)`: each rank writes its own files into the
        checkpoint before it is made final (e.g. the rollout producer's queued shares). Returns the
        folder the checkpoint will have."""
        from megatron.core import dist_checkpointing

        from patches.megatron_fixes import synchronous_save

        waited = self.wait() if self.pending is not None else 0.0  # one save in flight at a time
        start = time.monotonic()
        final, tmp = self.root / f"{PREFIX}{step:08d}", self.root / f"{PREFIX}{step:08d}.tmp"
        self._watch(step)
        requests = []
        try:
            experts = bool(getattr(learner.config, "num_moe_experts", None))
            strategy = _save_strategy(spread_group(learner.ctx, experts))  # collective: one small all-reduce
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            _barrier()
            with contextlib.ExitStack() as stack:
                if not self.async_save:
                    stack.enter_context(synchronous_save())
                state = _sharded_state(learner, is_loading=False)
                state["scheduler"] = learner.scheduler.state_dict()
                state["trainer"] = dict(trainer_state)
                requests.append(dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy,
                                                        async_sharded_save=True))
                for name, other in (others or {}).items():
                    # Made after the policy's save: dist_checkpointing warns about a non-empty folder.
                    if self.rank == 0:
                        (tmp / name).mkdir()
                    _barrier()
                    state = _sharded_state(other, is_loading=False)
                    state["scheduler"] = other.scheduler.state_dict()
                    requests.append(dist_checkpointing.save(state, str(tmp / name), sharded_strategy=strategy,
                                                            async_sharded_save=True))
                (tmp / "rng").mkdir(exist_ok=True)
                rng = tmp / "rng" / f"rank{self.rank}.pt"
                torch.save(_rng_state(), rng)
                _fsync(rng)
                if extra is not None:
                    extra(tmp)
                requests = [_staged(r) for r in requests]
                job = _Save(step, tmp, final, requests, start - waited, waited, waited_s=waited)
                if self.async_save:
                    fork = mp.get_context("fork")
                    job.done_at = fork.Value("d", 0.0, lock=False)
                    job.process = fork.Process(target=_forked_writer, args=(requests, job.done_at, os.getpid()),
                                               name=f"checkpoint-{step}")
                    job.forked_at = time.monotonic()
                    job.process.start()
                else:
                    _write_shards(requests)
        except CheckpointError:
            raise
        except BaseException as e:
            self._fail(step, e)
        job.blocked_s += time.monotonic() - start
        self.blocked_total_s += time.monotonic() - start
        self.pending = job
        if not self.async_save:
            self.poll(blocking=True)
        return final

    def poll(self, blocking: bool = False) -> bool:
        """Collective. Finish the pending save if every rank's shards are written (or, `blocking`,
        once they are); True when no save is pending any more."""
        job = self.pending
        if job is None:
            return True
        start = time.monotonic()
        try:
            if blocking and job.process is not None:
                job.process.join()
            done = job.process is None or not job.process.is_alive()
            failed = None
            if done and job.written_s is None:
                job.written_s = time.monotonic() - job.started
                failed = "; ".join(p for p in (_write_result(r, job.process) for r in job.requests) if p) or None
                if failed:
                    self._post_failure(failed)  # before the all-reduce: the others read it after
            # The writer's own time from the fork until its shards were on disk (not when a poll saw it)
            writer_s = max(0.0, job.done_at.value - job.forked_at) if done and job.done_at is not None else 0.0
            if self.world > 1:  # every rank decides alike: all written, or someone failed; the slowest writer
                flags = torch.tensor([0 if done else 1, 1 if failed else 0, round(writer_s * 1000)], dtype=torch.int64,
                                     device=self.device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                done, someone_failed, writer_s = int(flags[0]) == 0, int(flags[1]) == 1, int(flags[2]) / 1000
                if someone_failed and not failed:
                    self._abandon()
                    rank, message = self._read_failure(self._store) or ("another rank", "")
                    raise CheckpointError(f"checkpoint of step {job.step} failed on rank {rank}: {message}; the "
                                          "previous checkpoint is intact")
            if failed:
                raise _WriteFailed(failed)
            if not done:
                self.blocked_total_s += time.monotonic() - start
                return False
            for req in job.requests:  # megatron-core's: the metadata file (rank 0) after a gather
                for fn in req.finalize_fns:
                    fn()
            self._publish(job)
        except CheckpointError:
            raise
        except BaseException as e:
            self._fail(job.step, e)
        job.blocked_s += time.monotonic() - start
        self.blocked_total_s += time.monotonic() - start
        self.last = {"blocked_s": job.blocked_s, "waited_s": job.waited_s, "writer_s": writer_s,
                     "written_s": job.written_s, "total_s": time.monotonic() - job.started}
        self.recent.append(self.last)
        self.pending = None
        self._unwatch()
        return True

    def wait(self) -> float:
        """Collective: finish the pending save (if any); return the seconds it took here."""
        start = time.monotonic()
        self.poll(blocking=True)
        return time.monotonic() - start

    def _publish(self, job: _Save) -> None:
        if self.rank == 0:
            shutil.rmtree(job.final, ignore_errors=True)
            for folder in [job.tmp] + [p for p in job.tmp.iterdir() if p.is_dir()]:
                for name in ("metadata.json", "common.pt"):  # megatron-core's, written here (rank 0)
                    if (folder / name).is_file():
                        _fsync(folder / name)
            os.replace(job.tmp, job.final)
            _fsync(self.root)  # the rename is on disk before `latest` names the folder
            marker = self.root / "latest.tmp"
            with open(marker, "w") as f:
                f.write(job.final.name)
                f.flush()
                os.fsync(f.fileno())  # its content before the rename: never an empty `latest`
            os.replace(marker, self.root / "latest")
            _fsync(self.root)
            done = sorted(p for p in self.root.glob(f"{PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp"))
            for old in done[:-self.keep] if self.keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()

    # -- failure ---------------------------------------------------------------------------------
    def _post_failure(self, message: str) -> None:
        if self._store is not None:
            self._store.set(self._failed_key, f"{self.rank}\n{message}")

    def _read_failure(self, store) -> Optional[tuple[int, str]]:
        """(rank, error) posted by a failed rank, or None."""
        if not store.check([self._failed_key]):
            return None
        rank, message = store.get(self._failed_key).decode().split("\n", 1)
        return int(rank), message

    def _fail(self, step: int, error: BaseException):
        message = str(error) if isinstance(error, _WriteFailed) else f"{type(error).__name__}: {error}"
        if self._store is not None:
            try:
                self._post_failure(message)
                if self.rank == 0 and not isinstance(error, _WriteFailed):  # the store lives here: let the
                    # others read the message first (a write failure they learn at the all-reduce)
                    time.sleep(2.0)
            except Exception:
                pass
        self._abandon()
        raise CheckpointError(f"checkpoint of step {step} failed on rank {self.rank}: {message}; the previous "
                              f"checkpoint is intact") from error

    def _abandon(self) -> None:
        """Give up the pending save: its writer stops, its folder stays `.tmp` (never `latest`)."""
        self._unwatch()
        job, self.pending = self.pending, None
        if job is not None and job.process is not None and job.process.is_alive():
            job.process.kill()
            job.process.join()

    def _watch(self, step: int) -> None:
        if self._watch_store is None:
            return
        stop = self._watching = threading.Event()
        store = self._watch_store

        def watch() -> None:
            while not stop.wait(1.0):
                try:
                    failure = self._read_failure(store)
                    if failure is None or failure[0] == self.rank:
                        continue
                    rank, message = failure
                except dist.DistError:
                    rank, message = 0, "the c10d store it holds is gone (the process ended)"
                if stop.wait(self.grace_s):
                    return  # this rank raised by itself
                print(f"[megatron-rl] rank {self.rank}: checkpoint of step {step} failed on rank {rank}: {message}; "
                      f"ending this rank too (it waits in a collective rank {rank} will not join); the previous "
                      "checkpoint is intact", flush=True)
                os._exit(1)

        threading.Thread(target=watch, name="checkpoint-failure-watch", daemon=True).start()

    def _unwatch(self) -> None:
        if self._watching is not None:
            self._watching.set()
            self._watching = None


def save_checkpoint(learner, out_dir: str | Path, step: int, trainer_state: dict[str, Any],
                    keep: int = 2, others: Optional[dict[str, Any]] = None,
                    extra: Optional[Callable[[Path], None]] = None) -> Path:
    """Collective: a synchronous `Checkpointer.save` (see there)."""
    return Checkpointer(out_dir, keep).save(learner, step, trainer_state, others, extra)


def load_checkpoint(learner, path: str | Path, others: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler (and those of `others`, as saved) and this
    rank's RNG; return the trainer state."""
    path = Path(path)
    trainer_state = _load_learner(learner, path, with_trainer_state=True)
    for name, other in (others or {}).items():
        _load_learner(other, path / name)
    rng = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    return trainer_state
