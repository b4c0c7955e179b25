"""Real SGLang servers on CPU against HF transformers as the independent reference.

(a) tiny Qwen3: every generated token's rollout log-prob and the top-K lists equal HF's
    (fp32, temperature 1.0 and 0.7, HF logits divided by the temperature);
(b) tiny Qwen3-MoE: the routed experts SGLang returns equal HF's router top-k for the same
    tokens, with the alignment RolloutRecord documents;
(c) a server SIGKILLed mid-generation: every prompt still ends with exactly n samples, no
    duplicates, the retries are recorded, and the manager restarts the dead server.
Every generate call also checks `on_record`: called once per (prompt, sample) with the very
records the call returns. Record parsing and malformed responses: tests/unit/test_records.py.
The dense server is the session's shared one of its architecture (tests/e2e/conftest.py); the two
MoE servers are this module's own (one is killed).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_rl.models.tiny import make_tiny_checkpoint
from megatron_rl.rollout.client import RolloutClient, SamplingParams
from megatron_rl.rollout import auth
from megatron_rl.rollout.server import EngineManager, ServerConfig

pytestmark = pytest.mark.slow

K = 5
MOE_TOPK = 2
NUM_EXPERTS = 4
PROMPTS = [[5, 40, 41, 42], [1, 60, 61, 62, 63, 64, 65], [70, 71], [80, 81, 82, 83, 84]]


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dense(tmp_path_factory, shared_server):
    d = tmp_path_factory.mktemp("sglang_dense")
    # A larger init std gives peaked, varied next-token distributions (not near-uniform).
    ckpt = make_tiny_checkpoint(d / "ckpt", init_std=0.3, seed=1)
    # Deterministic mode (seeded sampling, fixed-tile GEMMs on CPU) must still equal HF.
    return ckpt, shared_server(ckpt, deterministic=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang_moe")
    ckpt = make_tiny_checkpoint(d / "ckpt", moe=True, topk=MOE_TOPK, num_experts=NUM_EXPERTS,
                                init_std=0.3, seed=2)
    # As in a job: its servers admit only requests with its key (rollout/auth.py), which every
    # request of this module's clients carries.
    auth.set_job_key(JOB_KEY)
    cfg = ServerConfig(model_path=str(ckpt), max_total_tokens=4096,
                       enable_return_routed_experts=True, env=auth.server_env())
    try:
        with EngineManager(cfg, 2, log_dir=d / "logs", watch_interval=0.5) as mgr:
            yield ckpt, mgr
    finally:
        auth.set_job_key(None)


JOB_KEY = auth.new_key()


def test_a_jobs_server_refuses_requests_without_its_key(moe):
    """Generation, a weight load, pausing, releasing memory and even reading the server's arguments
    need the job's key; health probes do not; the job's own requests succeed (this module's
    generations, a weight load here); the key is in neither the server's log nor its command line."""
    import json
    import urllib.error
    import urllib.request

    from megatron_rl.weights.endpoint import ServerEndpoint

    ckpt, mgr = moe
    url = mgr.urls()[0]

    def status(path, payload=None, key=None):
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        req = urllib.request.Request(url + path, data=None if payload is None else json.dumps(payload).encode(),
                                     headers=headers, method="GET" if payload is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert status("/health") == 200
    for path, payload in [("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}),
                          ("/update_weights_from_disk", {"model_path": "/tmp/elsewhere"}),
                          ("/pause_generation", {"mode": "abort"}), ("/release_memory_occupation", {}),
                          ("/server_info", None), ("/megatron_rl/versions", None)]:
        assert status(path, payload) == 401, path
        assert status(path, payload, key="not-the-key") == 401, path
    assert ServerEndpoint(url).post("/update_weights_from_disk", {"model_path": str(ckpt)})["success"]
    assert status("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}, JOB_KEY) == 200
    server = mgr.servers[0]
    log = server.log_path.read_text()
    assert JOB_KEY not in log and "'api_key': '<redacted>'" in log, log[-2000:]
    assert JOB_KEY not in Path(f"/proc/{server.pid}/cmdline").read_text()


def test_nccl_of_a_server_checked_against_the_learners(moe):
    """Before the weight-update group forms, each server's NCCL (its /megatron_rl/versions, from
    launch_server) must be the learner's; here the server's torch is a CPU build (no NCCL) and the
    learner is said to have 2.30.7, as a learner on a GPU image beside servers of a CPU image would."""
    from importlib.metadata import version

    from megatron_rl.weights.endpoint import ServerEndpoint, WeightSyncError, check_nccl, nccl_version

    ep = ServerEndpoint(moe[1].urls()[0])
    assert ep.get("/megatron_rl/versions") == {"torch": torch.__version__, "nccl": nccl_version(),
                                                "sglang": version("sglang")}
    check_nccl([ep])  # the same build on both sides
    with pytest.raises(WeightSyncError, match=r"rollout server http://\S+ has NCCL none \(torch .+\), the "
                                              r"learner NCCL 2\.30\.7: the weight-update group needs one NCCL"):
        check_nccl([ep], learner="2.30.7")


def _generate(mgr, sampling, n, prompts=PROMPTS, **kw):
    delivered = []

    async def go():
        async with RolloutClient(mgr, moe_topk=MOE_TOPK, num_experts=NUM_EXPERTS) as client:
            out = await client.generate(prompts, sampling, n=n, on_record=delivered.append, **kw)
            return out, client.retry_events

    out, events = asyncio.run(go())
    assert sorted((r.prompt_index, r.sample_index) for r in delivered) == [
        (i, j) for i in range(len(prompts)) for j in range(n)]
    assert {id(r) for r in delivered} == {id(r) for row in out for r in row}
    return out, events


def _check_against_hf(model, rec, temperature):
    P, T = rec.prompt_ids.numel(), rec.response_ids.numel()
    ids = torch.cat([rec.prompt_ids, rec.response_ids])
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()
    logp = torch.log_softmax(logits[P - 1 : P + T - 1] / temperature, dim=-1)  # [T, V]
    ref = logp.gather(1, rec.response_ids[:, None])[:, 0]
    torch.testing.assert_close(rec.rollout_logp, ref, atol=1e-4, rtol=0)
    if rec.topk_ids is None:
        return
    # Every listed log-prob is HF's log-prob of that id.
    torch.testing.assert_close(rec.topk_logp, logp.gather(1, rec.topk_ids), atol=1e-4, rtol=0)
    hf_top = logp.topk(K, dim=-1)
    for t in range(T):
        ids_t = rec.topk_ids[t].tolist()
        sampled = int(rec.response_ids[t])
        assert sampled in ids_t and len(set(ids_t)) == K
        assert bool((rec.topk_logp[t][:-1] >= rec.topk_logp[t][1:] - 1e-6).all())  # sorted
        forced = sampled not in hf_top.indices[t].tolist()
        listed = ids_t[:-1] if forced else ids_t
        if forced:
            assert ids_t[-1] == sampled
        # The (unforced) entries are HF's top-K: same ids wherever HF's values are not tied
        # within fp32 noise, and never below HF's K-th value.
        kth = float(hf_top.values[t, K - 1])
        assert float(logp[t, listed].min()) >= kth - 1e-4
        expected = hf_top.indices[t, : len(listed)].tolist()
        for a, b in zip(listed, expected):
            assert a == b or abs(float(logp[t, a] - logp[t, b])) < 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_topk_match_hf(dense, temperature):
    ckpt, mgr = dense
    out, _ = _generate(mgr, SamplingParams(temperature=temperature, max_new_tokens=16), n=2,
                       top_k_logprobs=K)
    model = _hf_model(ckpt)
    assert [len(row) for row in out] == [2] * len(PROMPTS)
    n_tokens = 0
    for i, row in enumerate(out):
        for j, rec in enumerate(row):
            assert (rec.prompt_index, rec.sample_index) == (i, j)
            assert rec.prompt_ids.tolist() == PROMPTS[i]
            assert rec.finish_reason in ("stop", "length") and rec.num_response_tokens >= 1
            assert rec.routed_experts is None and rec.temperature == temperature
            _check_against_hf(model, rec, temperature)
            n_tokens += rec.num_response_tokens
    assert n_tokens >= 16


def test_deterministic_mode_is_batch_invariant(dense):
    """A seeded sample's tokens and log-probs do not depend on which other requests share its
    forward batches: the same 4 prompts alone (8 requests) and amid 60 others (128 requests, so
    other prefill/decode batch sizes) give bit-identical records. Without the fixed-tile GEMMs of
    patches/sglang_cpu.py the log-probs differ in the last bits (MKL rounds by batch size)."""
    _, mgr = dense
    # Each prompt prefilled whole (patches/sglang_cpu.py deterministic_server_argv): a prompt split
    # by chunked prefill, which only a crowded batch does, is rounded otherwise than unsplit.
    with urllib.request.urlopen(mgr.urls()[0] + "/server_info", timeout=30) as resp:
        assert json.loads(resp.read())["chunked_prefill_size"] == -1
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1234)
    g = torch.Generator().manual_seed(0)
    others = [torch.randint(3, 90, (int(n),), generator=g).tolist()
              for n in torch.randint(2, 30, (60,), generator=g)]
    alone, _ = _generate(mgr, sampling, n=2)
    crowd, _ = _generate(mgr, sampling, n=2, prompts=PROMPTS + others)  # same seeds for PROMPTS
    for i in range(len(PROMPTS)):
        for a, b in zip(alone[i], crowd[i]):
            assert torch.equal(a.response_ids, b.response_ids), (i, a.sample_index)
            assert torch.equal(a.rollout_logp, b.rollout_logp), (i, a.rollout_logp - b.rollout_logp)


def test_stop_token_and_eos_are_kept(dense):
    ckpt, mgr = dense
    out, _ = _generate(mgr, SamplingParams(temperature=1.0, max_new_tokens=24,
                                           stop_token_ids=list(range(3, 120))), n=1)
    for (rec,) in out:
        # almost every token is a stop token here: the record ends on it, log-prob included
        assert rec.finish_reason == "stop"
        assert 3 <= int(rec.response_ids[-1]) < 120 or int(rec.response_ids[-1]) == 2
        _check_against_hf(_hf_model(ckpt), rec, 1.0)


def test_spawned_children_serve_as_forked_ones(dense, tmp_path):
    """On CPU, SGLang's scheduler and detokenizer are forked from the patched server process
    (patches/sglang_cpu.py); on GPUs they are spawned and re-import launch_server, which applies the
    patches again. A server started the GPU way (SGLANG_CPU_START_METHOD=spawn) must serve the same
    seeded samples bit for bit: the seeded-sampling hash and the fixed-tile GEMMs are patches that
    only work in the scheduler child if they reached it."""
    ckpt, forked = dense
    cfg = ServerConfig(model_path=str(ckpt), max_total_tokens=8192, env={"SGLANG_CPU_START_METHOD": "spawn"},
                       extra_args=("--weight-version", "0", "--enable-deterministic-inference"))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=99)
    with EngineManager(cfg, 1, log_dir=tmp_path / "logs") as spawned:
        a, _ = _generate(spawned, sampling, n=2, top_k_logprobs=K)
    b, _ = _generate(forked, sampling, n=2, top_k_logprobs=K)
    log = (tmp_path / "logs" / "server0.log").read_text()
    assert "scheduler and detokenizer start by spawn" in log
    assert "start by fork" in (forked.log_dir / "server0.log").read_text()
    for row_a, row_b in zip(a, b):
        for x, y in zip(row_a, row_b):
            assert torch.equal(x.response_ids, y.response_ids)
            assert torch.equal(x.rollout_logp, y.rollout_logp)
            assert torch.equal(x.topk_ids, y.topk_ids) and torch.equal(x.topk_logp, y.topk_logp)


def test_routed_experts_match_hf_router(moe):
    ckpt, mgr = moe
    out, _ = _generate(mgr, SamplingParams(temperature=1.0, max_new_tokens=12), n=2,
                       top_k_logprobs=K, return_routed_experts=True)
    model = _hf_model(ckpt)
    layers = model.model.layers
    captured: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, inp, o: captured.append(o[0]))
             for layer in layers]
    try:
        for row in out:
            for rec in row:
                P, T = rec.prompt_ids.numel(), rec.response_ids.numel()
                _check_against_hf(model, rec, 1.0)  # log-probs of the MoE model too
                captured.clear()
                ids = torch.cat([rec.prompt_ids, rec.response_ids])[:-1]  # P+T-1 input positions
                with torch.no_grad():
                    model(ids[None])
                # HF router logits per layer [P+T-1, E] -> top-k expert ids [P+T-1, L, k]
                hf = torch.stack([lg.reshape(P + T - 1, -1).topk(MOE_TOPK, dim=-1).indices
                                  for lg in captured], dim=1)
                assert rec.routed_experts.shape == (T, len(layers), MOE_TOPK)
                assert rec.prompt_routed_experts.shape == (P - 1, len(layers), MOE_TOPK)
                seq = rec.sequence_routed_experts()
                assert torch.equal(seq.sort(-1).values.long(), hf.sort(-1).values)
                # routed_experts[t] is the step that produced response token t: position P-1+t
                assert torch.equal(rec.routed_experts.sort(-1).values.long(),
                                   hf[P - 1 :].sort(-1).values)
    finally:
        for h in hooks:
            h.remove()


def test_killed_server_mid_generation(moe):
    ckpt, mgr = moe
    victim = mgr.servers[0]
    victim_url = victim.url
    n = 4

    async def go():
        async with RolloutClient(mgr, moe_topk=MOE_TOPK, num_experts=NUM_EXPERTS,
                                 backoff_initial=0.2) as client:
            task = asyncio.ensure_future(client.generate(
                PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=150), n=n,
                top_k_logprobs=K, return_routed_experts=True))
            deadline = time.monotonic() + 60
            while not client._inflight.get(victim_url) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            in_flight = len(client._inflight.get(victim_url, {}))
            await asyncio.sleep(0.3)
            victim.kill()  # SIGKILL the server's main process while its requests run
            return await task, client.retry_events, in_flight

    out, events, in_flight = asyncio.run(go())
    assert in_flight > 0
    keys = [(r.prompt_index, r.sample_index) for row in out for r in row]
    assert len(keys) == len(set(keys)) == len(PROMPTS) * n
    assert all(len(row) == n for row in out)
    assert all(r.finish_reason in ("stop", "length") for row in out for r in row)
    assert any(e.url == victim_url for e in events), events
    # the watchdog notices the death and brings the server back on its port
    deadline = time.monotonic() + 240
    while not (mgr.restart_events and victim.healthy()) and time.monotonic() < deadline:
        time.sleep(1)
    assert [e[0] for e in mgr.restart_events] == [0]
    assert victim.healthy() and victim.restarts == 1 and victim.url == victim_url
    # restarted from the watchdog thread, still in a process group of its own (a terminal's Ctrl-C
    # reaches only its trainer) and told to exit with its parent (tests/e2e/test_server_lifeline.py)
    assert os.getpgid(victim.pid) == victim.pid != os.getpgid(0)
    assert "--exit-with-parent" in victim.command()
    # the restarted server serves correct routed experts again
    out2, _ = _generate(mgr, SamplingParams(temperature=1.0, max_new_tokens=4), n=2,
                        return_routed_experts=True)
    assert all(r.routed_experts.shape[0] == r.num_response_tokens for row in out2 for r in row)



def test_a_server_whose_port_is_taken_while_it_starts_moves_to_another(dense, tmp_path):
    """A port drawn free can be taken in the seconds a server imports before it binds it (another
    process's bind or outgoing connection: a CI run lost a reward server so). `wait_healthy` sees
    the bind fail in this start's log, stops the server and starts it again on a new port, where it
    serves; its URL is the new one."""
    import socket

    from megatron_rl.rollout.server import BIND_FAILED, LISTEN_PORTS, SGLangServer, free_port, http_ok

    ckpt, _ = dense
    port = free_port()
    server = SGLangServer(0, ServerConfig(model_path=str(ckpt), max_total_tokens=4096), port, tmp_path / "s.log")
    server.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
            squatter.bind(("127.0.0.1", port))  # taken while the server imports
            squatter.listen()
            server.wait_healthy()
        assert server.port != port and LISTEN_PORTS[0] <= server.port <= LISTEN_PORTS[1]
        assert server.url.endswith(f":{server.port}") and http_ok(server.url + "/health_generate", 30)
        log = (tmp_path / "s.log").read_bytes()
        assert log.count(b"===== megatron-rl: start") == 2 and log.count(BIND_FAILED) == 1
    finally:
        server.stop()
