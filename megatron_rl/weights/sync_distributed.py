"""Weight sync over a process group of the learner's rank 0 and every server's TP ranks.

The learner (rank 0 of the group) broadcasts each bucket as one flat byte tensor (SGLang's
`flattened_bucket` load format) while each server, asked over HTTP, receives it and loads it.
NCCL on GPU, gloo on CPU; servers may sit on other nodes. Every update runs inside
begin/end_weight_update (SGLang refuses it otherwise) and ends with a cache flush.

Group ranks: 0 is the learner; server i's TP rank t is 1 + (TP sizes of servers before i) + t
(SGLang joins at rank_offset + tp_rank), so the world is 1 + the sum of the servers' TP sizes.
Those sizes must be the servers' real ones (`ServerEndpoint.tp_size`, read from each server's
/server_info by rollout/placement.py): a wrong count leaves the rendezvous waiting for ranks that
never come. SGLang refuses all of this on a server with dp_size > 1: one server per replica.

Buckets are pipelined: a sender thread broadcasts bucket i (and waits for the servers to load it)
while the calling thread goes on with the export, gathering bucket i+1 (models/weight_export.py:
a fixed number of collectives per bucket) and copying it into its flat buffer; at most two flat
buckets exist at once. The learner's collectives and this group's broadcast are on different
process groups, so the two threads never wait on each other's collectives.

A server lost during a push (killed, OOM, its node gone) is seen in seconds, not at the group's
timeout: each bucket's broadcast is asynchronous, and the sender waits on the servers' answers
first. The first server whose request fails (connection refused or reset), or a broadcast that
fails (gloo notices a closed peer), aborts the update group (NCCL would otherwise wait for the
dead rank until its timeout, 30 minutes) and raises `WeightSyncError` naming the server. The
surviving servers' sessions are ended where they still answer (10 s, all at once), and the error
ends the step: the trainer exits and the launcher requeues the job from the last checkpoint
(slurm/megatron_rl.sbatch); the servers it starts again join a new group. Every request to a
server runs on a daemon thread: a process that ends never waits on a server that does not answer.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_rl.weights.buckets import bucketize
from megatron_rl.weights.endpoint import ServerEndpoint, ServersUnreachable, WeightSyncError, begin_update


class DistributedWeightSync:
    def __init__(self, servers: Sequence[ServerEndpoint], *, master_addr: str, master_port: int = 0,
                 backend: str | None = None, group_name: str = "megatron_rl_weights",
                 bucket_bytes: int = 256 << 20, timeout_s: float = 600.0):
        self.servers = list(servers)
        self.master_addr, self.master_port = master_addr, master_port
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.group_name, self.bucket_bytes, self.timeout_s = group_name, bucket_bytes, timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.group = None

    def _all(self, path: str, payload: dict, timeout_s: float | None = None) -> list[dict]:
        futures = [background(s.post, path, payload, timeout_s or self.timeout_s) for s in self.servers]
        return [f.result() for f in futures]

    def _end_quietly(self) -> None:
        """After a failed push: end each server's session where it still answers (10 s, all at once);
        a server that is gone, or stuck in a broadcast that will not come, is left to the launcher."""
        for f in [background(s.post, "/end_weight_update", {}, 10.0) for s in self.servers]:
            try:
                f.result()
            except WeightSyncError:
                pass

    def _begin(self) -> None:
        """begin_weight_update on every server. One that does not answer (gone) ends the others' and
        raises ServersUnreachable: nothing was sent and the caller's tensors are untouched; another
        failure ends them and raises as it is."""
        futures = [background(begin_update, s, self.timeout_s) for s in self.servers]
        failed = []
        for s, f in zip(self.servers, futures):
            try:
                f.result()
            except WeightSyncError as e:
                failed.append((s, e))
        if failed:
            for s, f in zip(self.servers, futures):
                if all(s is not bad for bad, _ in failed):
                    try:
                        s.post("/end_weight_update", {}, self.timeout_s)
                    except WeightSyncError:
                        pass
            message = "; ".join(str(e) for _, e in failed)
            if all(e.unreachable for _, e in failed):
                raise ServersUnreachable(message, unreachable=True)
            raise WeightSyncError(message)

    def connect(self) -> None:
        """Form the group: the servers join over HTTP while this process joins as rank 0. With
        master_port 0 (the default) the store listens on a port the kernel picks as it binds."""
        from megatron_rl.weights.process_group import host_store, new_side_group

        world = 1 + sum(s.tp_size for s in self.servers)
        offsets, nxt = [], 1
        for s in self.servers:
            offsets.append(nxt)
            nxt += s.tp_size
        store = host_store(self.master_addr, world, self.master_port)
        self.master_port = store.port
        futures = [
            background(s.post, "/init_weights_update_group", {
                "master_address": self.master_addr, "master_port": self.master_port,
                "rank_offset": off, "world_size": world, "group_name": self.group_name,
                "backend": self.backend}, self.timeout_s)
            for s, off in zip(self.servers, offsets)
        ]
        self.group = new_side_group(self.backend, f"tcp://{self.master_addr}:{self.master_port}",
                                    world_size=world, rank=0, group_name=self.group_name, store=store)
        for f in futures:
            f.result()

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> dict:
        """Send every (HF name, tensor); returns {"bytes", "seconds", "buckets"}."""
        if self.group is None:
            raise WeightSyncError("DistributedWeightSync.push before connect()")
        start, nbytes, nbuckets = time.perf_counter(), 0, 0
        self._begin()
        sending = None
        try:
            for bucket in bucketize(named_tensors, self.bucket_bytes, copy=False):
                flat = bucket.flatten().to(self.device)  # our own copy: the export may go on
                payload = {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                           "group_name": self.group_name, "load_format": "flattened_bucket",
                           "flush_cache": False, "weight_version": weight_version}
                del bucket
                if sending is not None:
                    sending.result()  # one bucket in flight: at most two flat buffers exist
                sending = background(self._send, flat, payload)
                nbytes += flat.numel()
                nbuckets += 1
                del flat
            if sending is not None:
                sending.result()
        except BaseException:
            if sending is not None:
                sending.exception()  # never end the update while a broadcast is still running
            self._end_quietly()
            raise
        self._all("/end_weight_update", {})
        self._all("/flush_cache", {})
        return {"bytes": nbytes, "seconds": time.perf_counter() - start, "buckets": nbuckets}

    def _send(self, flat: torch.Tensor, payload: dict) -> None:
        """One bucket: every server asked to receive it, the broadcast, every server's answer. The
        answers are awaited first: a server that fails (gone) aborts the group at once."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        answers = {background(s.post, "/update_weights_from_distributed", payload, self.timeout_s): s
                   for s in self.servers}
        work = dist.broadcast(flat, src=0, group=self.group, async_op=True)
        pending = set(answers)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    self._abort()
                    e = f.exception()
                    raise WeightSyncError(
                        f"rollout server {answers[f].url} failed during the weight push ({e}); the update "
                        "group is aborted, this step ends", unreachable=getattr(e, "unreachable", False)) from e
            if pending and work.is_completed():
                try:
                    work.wait()  # gloo: a peer that closed its connection fails the broadcast
                except RuntimeError as e:
                    self._abort()
                    raise WeightSyncError(f"the weight push's broadcast failed ({e}); the update group is "
                                          "aborted, this step ends", unreachable=True) from e
        work.wait()

    def _abort(self) -> None:
        """Abort the update group: a broadcast waiting on a dead rank returns (NCCL would wait until
        the group's timeout), and the group is never used again."""
        group, self.group = self.group, None
        if group is not None:
            try:
                dist.distributed_c10d._abort_process_group(group)
            except Exception:  # noqa: BLE001 -- best effort: the step fails either way
                pass

    def close(self) -> None:
        if self.group is not None:
            try:
                self._all("/destroy_weights_update_group", {"group_name": self.group_name}, timeout_s=30.0)
            except WeightSyncError:
                pass  # a server that is already gone has nothing to tear down
            dist.destroy_process_group(self.group)
            self.group = None


def background(fn: Callable, *args) -> Future:
    """fn(*args) on a daemon thread: the process may end while a server has not answered (a pool's
    threads would be joined at exit, for up to a request's timeout)."""
    future: Future = Future()

    def run():
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                future.set_exception(e)

    threading.Thread(target=run, daemon=True, name=f"weight-sync-{getattr(fn, '__name__', 'call')}").start()
    return future
