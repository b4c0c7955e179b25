"""A weight push that finds a server gone before it sends anything (the server died between the
trainer's restart check and the push): both transports raise ServersUnreachable without touching
the tensors (so the trainer restarts the server and pushes the same export again,
rollout/fleet.py `sync_weights`), and the servers that had begun an update are told to end it.
The trainer-level path runs in tests/e2e/test_async_training.py (a killed server mid-run)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.weights.endpoint import ServersUnreachable, WeightSyncError
from megatron_rl.weights.sync_distributed import DistributedWeightSync
from megatron_rl.weights.sync_tensor import TensorWeightSync


class Endpoint:
    """SGLang's weight-update session rules (scheduler_components/weight_updater.py): one open
    session at a time."""

    def __init__(self, url: str, gone: bool = False, open_session: bool = False):
        self.url, self.gone, self.tp_size, self.calls, self.open = url, gone, 1, [], open_session

    def post(self, path, payload=None, timeout=600.0):
        if self.gone:
            raise WeightSyncError(f"{self.url}{path}: <urlopen error [Errno 111] Connection refused>",
                                  unreachable=True)
        self.calls.append(path)
        if path == "/begin_weight_update":
            if self.open:
                raise WeightSyncError(f"{self.url}{path}: a weight-update session is already open; "
                                      "call end_weight_update() first")
            self.open = True
        elif path == "/end_weight_update":
            if not self.open:
                raise WeightSyncError(f"{self.url}{path}: no weight-update session is open")
            self.open = False
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


@pytest.mark.parametrize("kind", ["distributed", "tensor"])
def test_a_session_left_open_by_a_killed_pusher_is_ended_first(kind):
    """A trainer killed between begin and end leaves its (still running) server's session open; the
    next push ends it and goes on (it failed every later run on that server before)."""
    stale, fresh = Endpoint("http://a:1", open_session=True), Endpoint("http://b:2")
    t = (TensorWeightSync([stale, fresh]) if kind == "tensor"
         else DistributedWeightSync([stale, fresh], master_addr="127.0.0.1", master_port=1))
    if kind == "distributed":
        t._begin()
    else:
        from megatron_rl.weights import sync_tensor

        for s in (stale, fresh):
            sync_tensor.begin_update(s, 1.0)
    assert stale.calls == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update"]
    assert fresh.calls == ["/begin_weight_update"] and stale.open and fresh.open


def test_a_refusal_is_not_taken_for_a_gone_server():
    class Refusing(Endpoint):
        def post(self, path, payload=None, timeout=600.0):
            raise WeightSyncError(f"{self.url}{path}: HTTP 400: weight updates are disabled")

    t = DistributedWeightSync([Endpoint("http://a:1"), Refusing("http://b:2")], master_addr="127.0.0.1",
                              master_port=1)
    with pytest.raises(WeightSyncError, match="disabled") as e:
        t._begin()
    assert not isinstance(e.value, ServersUnreachable)  # the trainer would restart nothing and retry in vain


def test_servers_are_asked_their_version_all_at_once(monkeypatch):
    """Before a push rank 0 asks every configured server its weight version (`answering`); the
    ones that do not answer cost one timeout together, not one each."""
    import time
    import types

    from megatron_rl.rollout.pushes import WeightPushes
    from megatron_rl.weights import endpoint

    def get(self, path, timeout=60.0):
        assert path == "/get_model_info"
        if "dead" in self.url:
            time.sleep(0.5)  # its timeout
            raise WeightSyncError(f"{self.url}{path}: timed out", unreachable=True)
        return {"weight_version": self.url.rsplit(":", 1)[1]}

    monkeypatch.setattr(endpoint.ServerEndpoint, "get", get)
    r = object.__new__(WeightPushes)
    urls = ["http://a:3", "http://dead1:1", "http://dead2:1", "http://dead3:1", "http://b:4"]
    r.cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(server_urls=urls))
    start = time.monotonic()
    assert r.answering(wait_s=0) == {"http://a:3": "3", "http://b:4": "4"}
    assert time.monotonic() - start < 1.2  # 3 dead servers one after another: 1.5 s


def test_a_server_lost_mid_push_fails_the_push_in_seconds_and_aborts_the_group():
    """A server that dies after it was asked to receive a bucket (its request fails: connection
    reset) ends the push at once, while another server still waits in the broadcast (as a survivor
    would wait in an NCCL broadcast that never comes): the group is aborted, the error names the
    lost server, the survivors' sessions are ended, and the export is not read further. Before,
    the learner waited in the broadcast until the group's timeout (NCCL: 30 minutes)."""
    import threading
    import time

    from megatron_rl.weights.process_group import host_store, new_side_group

    stuck = threading.Event()

    class Lost(Endpoint):
        def post(self, path, payload=None, timeout=600.0):
            if path == "/update_weights_from_distributed":
                time.sleep(0.2)
                self.gone = True  # killed while it receives
            return super().post(path, payload, timeout)

    class Waiting(Endpoint):
        def post(self, path, payload=None, timeout=600.0):
            if path == "/update_weights_from_distributed":
                stuck.wait(timeout)  # never answers: its broadcast does not come
            return super().post(path, payload, timeout)

    ok, lost, waiting = Endpoint("http://a:1"), Lost("http://b:2"), Waiting("http://c:3")
    # The waiting one first: answers awaited in order would wait on it for the request timeout.
    t = DistributedWeightSync([waiting, ok, lost], master_addr="127.0.0.1", bucket_bytes=64, timeout_s=60)
    store = host_store("127.0.0.1", 1)
    t.group = new_side_group("gloo", f"tcp://127.0.0.1:{store.port}", world_size=1, rank=0,
                             group_name="test_lost_mid_push", store=store)  # the learner alone
    read = []

    def named():
        for i in range(8):  # 8 buckets of 64 bytes
            read.append(i)
            yield f"layers.{i}.weight", torch.zeros(16)

    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"rollout server http://b:2 failed during the weight push "
                                                  r"\(.*Connection refused.*\); the update group is aborted") as e:
            t.push(named(), weight_version="4")
        assert time.monotonic() - start < 3.0
        assert e.value.unreachable
        assert t.group is None  # aborted: never used again (the trainer forms a new one)
        # bucket 0 in flight, bucket 1 exported and waiting (its end seen by reading tensor 2): no more
        assert read == [0, 1, 2]
        assert ok.calls[-1] == "/end_weight_update" and waiting.calls[-1] == "/end_weight_update"
        assert not ok.open and not waiting.open
    finally:
        stuck.set()


def test_a_host_push_copies_with_one_intra_op_thread_and_gives_the_threads_back():
    """`push_weights` from host memory: the export and the transport's copies run with one intra-op
    thread (a parallel copy's OpenMP threads took the cores the sender thread and the servers
    needed), the learner's thread count is restored after the push and after a failed one, and a
    learner on CUDA is left as it is."""
    from types import SimpleNamespace

    from megatron_rl.weights.push import push_weights

    seen = []

    class Learner:
        def __init__(self, device):
            self.ctx = SimpleNamespace(device=torch.device(device))

        def export_hf_weights(self):
            seen.append(("export", torch.get_num_threads()))
            yield "w", torch.ones(4)

    class Transport:
        def __init__(self, fail=False):
            self.fail = fail

        def push(self, named, weight_version=None):
            names = [n for n, _ in named]
            seen.append(("push", torch.get_num_threads()))
            if self.fail:
                raise WeightSyncError("server lost")
            return {"names": names}

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert push_weights(Learner("cpu"), Transport()) == {"names": ["w"]}
        assert seen == [("export", 1), ("push", 1)] and torch.get_num_threads() == 2
        seen.clear()
        with pytest.raises(WeightSyncError):
            push_weights(Learner("cpu"), Transport(fail=True))
        assert seen == [("export", 1), ("push", 1)] and torch.get_num_threads() == 2
        seen.clear()
        push_weights(Learner("cuda"), Transport())  # (no CUDA needed: the learner only says where it is)
        assert seen == [("export", 2), ("push", 2)]
    finally:
        torch.set_num_threads(before)
