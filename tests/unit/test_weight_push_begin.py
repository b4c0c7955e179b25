"""A weight push that finds a server gone before it sends anything (the server died between the
trainer's restart check and the push): both transports raise ServersUnreachable without touching
the tensors (so the trainer restarts the server and pushes the same export again,
trainer/rollouts.py `sync_weights`), and the servers that had begun an update are told to end it.
The trainer-level path runs in tests/e2e/test_async_training.py (a killed server mid-run)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.weights.endpoint import ServersUnreachable, WeightSyncError
from megatron_rl.weights.sync_distributed import DistributedWeightSync
from megatron_rl.weights.sync_tensor import TensorWeightSync


class Endpoint:
    def __init__(self, url: str, gone: bool = False):
        self.url, self.gone, self.tp_size, self.calls = url, gone, 1, []

    def post(self, path, payload=None, timeout=600.0):
        if self.gone:
            raise WeightSyncError(f"{self.url}{path}: <urlopen error [Errno 111] Connection refused>")
        self.calls.append(path)
        return {"success": True}


def _named(consumed):
    consumed.append(True)
    yield "model.embed_tokens.weight", torch.zeros(4, 2)


@pytest.mark.parametrize("kind", ["distributed", "tensor"])
def test_a_server_gone_at_begin_raises_before_anything_is_sent(kind):
    live, dead = Endpoint("http://a:1"), Endpoint("http://b:2", gone=True)
    if kind == "distributed":
        t = DistributedWeightSync([live, dead], master_addr="127.0.0.1", master_port=1)
        t.group = object()  # formed earlier; a push to a gone server must fail before using it
    else:
        t = TensorWeightSync([live, dead])
    consumed: list = []
    with pytest.raises(ServersUnreachable, match=r"http://b:2/begin_weight_update: .*Connection refused"):
        t.push(_named(consumed), weight_version="3")
    assert consumed == []  # the export was not started: the other ranks wait in its first collective
    assert live.calls == ["/begin_weight_update", "/end_weight_update"]
    assert issubclass(ServersUnreachable, WeightSyncError)
