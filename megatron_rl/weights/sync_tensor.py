"""Weight sync by tensor handles over HTTP, for CPU servers on the learner's machine.

Each bucket is pickled with multiprocessing's ForkingPickler and base64-encoded (the format
SGLang's `MultiprocessingSerializer` reads): shared-memory files, which needs the "file_system"
sharing strategy (the server dies on a file-descriptor handle), posted to
`/update_weights_from_tensor`; the server maps the same memory, so only handles cross HTTP. Every
TP rank of a server gets the same handles, which is right for shared memory. The tensors stay
alive here until the server has loaded them.

CPU tensors only. On GPUs the handles would be CUDA IPC handles of learner rank 0's GPU, sent to
server ranks on other GPUs; per-GPU handles are not implemented, so CUDA tensors are refused here
(and `rollout.weight_sync=tensor` with CUDA servers at config validation): use the process-group
transport (NCCL) on GPUs.
"""

from __future__ import annotations

import base64
import io
import time
from multiprocessing.reduction import ForkingPickler
from typing import Iterable, Sequence

import torch

from megatron_rl.weights.buckets import bucketize
from megatron_rl.weights.endpoint import ServerEndpoint, ServersUnreachable, WeightSyncError, begin_update


def serialize_handles(obj) -> str:
    """Pickle with tensor storages as shareable handles; base64 text for the JSON body."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


class TensorWeightSync:
    def __init__(self, servers: Sequence[ServerEndpoint], *, bucket_bytes: int = 256 << 20,
                 timeout_s: float = 600.0):
        self.servers, self.bucket_bytes, self.timeout_s = list(servers), bucket_bytes, timeout_s
        torch.multiprocessing.set_sharing_strategy("file_system")

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> dict:
        start, nbytes, nbuckets = time.perf_counter(), 0, 0
        begun = []
        for s in self.servers:
            try:
                begin_update(s, self.timeout_s)
            except WeightSyncError as e:  # nothing sent yet, and `named_tensors` untouched
                for other in begun:
                    try:
                        other.post("/end_weight_update", {}, self.timeout_s)
                    except WeightSyncError:
                        pass
                if e.unreachable:
                    raise ServersUnreachable(str(e), unreachable=True) from e
                raise
            begun.append(s)
        try:
            for bucket in bucketize(named_tensors, self.bucket_bytes):
                if any(t.is_cuda for t in bucket.tensors):
                    raise WeightSyncError(
                        "tensor weight sync got CUDA tensors: their IPC handles would point at this "
                        "rank's GPU for every server TP rank (per-GPU handles are not implemented); use "
                        "rollout.weight_sync=distributed on GPUs")
                named = list(zip(bucket.names, bucket.tensors))
                for s in self.servers:
                    blob = serialize_handles(named)
                    s.post("/update_weights_from_tensor", {
                        "serialized_named_tensors": [blob] * s.tp_size, "flush_cache": False,
                        "weight_version": weight_version}, self.timeout_s)
                nbytes += bucket.nbytes
                nbuckets += 1
        finally:
            for s in self.servers:
                s.post("/end_weight_update", {}, self.timeout_s)
        for s in self.servers:
            s.post("/flush_cache", {}, self.timeout_s)
        return {"bytes": nbytes, "seconds": time.perf_counter() - start, "buckets": nbuckets}
