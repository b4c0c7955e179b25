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
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Sequence

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
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.servers)))
        # The sender thread's CUDA device is the learner's (a new thread starts on device 0).
        self._sender = ThreadPoolExecutor(max_workers=1, initializer=(
            (lambda: torch.cuda.set_device(self.device)) if self.device.type == "cuda" else None))

    def _all(self, path: str, payload: dict) -> list[dict]:
        futures = [self._pool.submit(s.post, path, payload, self.timeout_s) for s in self.servers]
        return [f.result() for f in futures]

    def _begin(self) -> None:
        """begin_weight_update on every server. One that does not answer (gone) ends the others' and
        raises ServersUnreachable: nothing was sent and the caller's tensors are untouched; another
        failure ends them and raises as it is."""
        futures = [self._pool.submit(begin_update, s, self.timeout_s) for s in self.servers]
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
            self._pool.submit(s.post, "/init_weights_update_group", {
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
                sending = self._sender.submit(self._send, flat, payload)
                nbytes += flat.numel()
                nbuckets += 1
                del flat
            if sending is not None:
                sending.result()
        finally:
            if sending is not None:
                sending.exception()  # never end the update while a broadcast is still running
            self._all("/end_weight_update", {})
        self._all("/flush_cache", {})
        return {"bytes": nbytes, "seconds": time.perf_counter() - start, "buckets": nbuckets}

    def _send(self, flat: torch.Tensor, payload: dict) -> None:
        """One bucket: every server asked to receive it, the broadcast, every server's answer."""
        futures = [self._pool.submit(s.post, "/update_weights_from_distributed", payload, self.timeout_s)
                   for s in self.servers]
        dist.broadcast(flat, src=0, group=self.group)
        for f in futures:
            f.result()

    def close(self) -> None:
        if self.group is not None:
            try:
                self._all("/destroy_weights_update_group", {"group_name": self.group_name})
            except WeightSyncError:
                pass  # a server that is already gone has nothing to tear down
            dist.destroy_process_group(self.group)
            self.group = None
        self._pool.shutdown(wait=False)
        self._sender.shutdown(wait=False)
