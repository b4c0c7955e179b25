"""Weight sync by tensor handles over HTTP, for servers sharing the learner's devices.

Each bucket is pickled with multiprocessing's ForkingPickler and base64-encoded — the format
SGLang's `MultiprocessingSerializer` reads (CUDA IPC handles on GPU; on CPU, shared-memory files,
which needs the "file_system" sharing strategy, or the server dies on the handle) and posted to `/update_weights_from_tensor`; the server maps the same memory, so
only handles cross HTTP. The tensors stay alive here until the server has loaded them.
"""

from __future__ import annotations

import base64
import io
import time
from multiprocessing.reduction import ForkingPickler
from typing import Iterable, Sequence

import torch

from megatron_rl.weights.buckets import bucketize
from megatron_rl.weights.endpoint import ServerEndpoint


def serialize_handles(obj) -> str:
    """Pickle with tensor storages as shareable handles; base64 text for the JSON body."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


class TensorWeightSync:
    def __init__(self, servers: Sequence[ServerEndpoint], *, bucket_bytes: int = 256 << 20,
                 timeout_s: float = 600.0):
        self.servers, self.bucket_bytes, self.timeout_s = list(servers), bucket_bytes, timeout_s
        if not torch.cuda.is_available():
            torch.multiprocessing.set_sharing_strategy("file_system")

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> dict:
        start, nbytes, nbuckets = time.perf_counter(), 0, 0
        for s in self.servers:
            s.post("/begin_weight_update", {}, self.timeout_s)
        try:
            for bucket in bucketize(named_tensors, self.bucket_bytes):
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
