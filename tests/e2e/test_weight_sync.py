"""Learner -> SGLang weight sync, by process group (gloo) and by tensor handles, on a real server.

After a training step the server still serves the old weights (its log-probs differ from the
learner's); after a sync its log-probs of a probe prompt equal the learner's new ones (fp32).
With FP8 rollouts (CPU: weights rounded through e4m3 blocks) they equal transformers' on the
rounded weights instead, and differ from the learner's by exactly that rounding.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

PROBE = [1, 40, 41, 18, 20, 19, 22, 2, 5, 1, 13, 17, 21, 30]


def server_logprobs(url: str, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from the server's input-token log-probs."""
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
               "return_logprob": True, "logprob_start_len": 0}
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        meta = json.loads(r.read())["meta_info"]
    return torch.tensor([lp[0] for lp in meta["input_token_logprobs"][1:]], dtype=torch.float64)


def sync_worker(rank, world_size, hf_path, url):
    from megatron_rl.config.schema import JobConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.weights.endpoint import ServerEndpoint
    from megatron_rl.weights.push import push_weights
    from megatron_rl.weights.sync_distributed import DistributedWeightSync
    from megatron_rl.weights.sync_tensor import TensorWeightSync

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.optim.lr = 1e-2
    cfg.learner.micro_batch_size = 2
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir="/nonexistent")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (2, 16), generator=g)
    batch = dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=torch.ones(2, 16))
    probe_ids = torch.tensor([PROBE])
    probe = dict(input_ids=probe_ids, labels=torch.roll(probe_ids, -1, 1),
                 loss_mask=torch.ones(1, len(PROBE)))
    out = {"initial_learner": learner.forward_logprobs(probe)[0, :-1].double(),
           "initial_server": server_logprobs(url, PROBE)}
    endpoint = ServerEndpoint(url)
    for name, transport in [
        ("distributed", DistributedWeightSync([endpoint], master_addr="127.0.0.1")),
        ("tensor", TensorWeightSync([endpoint])),
    ]:
        learner.train_step(batch)
        new = learner.forward_logprobs(probe)[0, :-1].double()
        stale = server_logprobs(url, PROBE)
        if hasattr(transport, "connect"):
            transport.connect()
        stats = push_weights(learner, transport, weight_version=name)
        out[name] = dict(learner=new, stale=stale, synced=server_logprobs(url, PROBE), stats=stats)
        if hasattr(transport, "close"):
            transport.close()
    # FP8 rollouts on a CPU server: the push rounds every projection through e4m3 blocks; the
    # reference is transformers on the same rounded weights.
    from megatron_rl.weights.fp8 import ServedWeights

    served = ServedWeights("fp8", "round")
    rounded = dict(served.apply(learner.export_hf_weights()))
    push_weights(learner, TensorWeightSync([endpoint]), weight_version="fp8", served=served)
    out["fp8"] = dict(learner=learner.forward_logprobs(probe)[0, :-1].double(),
                      synced=server_logprobs(url, PROBE), rounded=rounded)
    return out


def hf_logprobs(hf_path, state, ids) -> torch.Tensor:
    """log p(ids[t] | ids[:t]), t >= 1, from transformers with the given weights (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    device = next(model.parameters()).device
    with torch.no_grad():
        logp = model(torch.tensor([ids], device=device)).logits[0, :-1].double().log_softmax(-1)
    return logp.gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0].cpu()


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared_server):
    """The session's shared server of this architecture in SGLang's default mode (tests/e2e/conftest.py)."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("sync") / "model")
    return ckpt, shared_server(ckpt, deterministic=False).urls()[0]


@pytest.mark.slow
def test_sync_by_process_group_and_by_tensor(server):
    ckpt, url = server
    out = run_distributed(sync_worker, 1, str(ckpt), url)[0]
    # Same weights at the start: the server and the learner agree.
    assert (out["initial_server"] - out["initial_learner"]).abs().max() <= 1e-4
    for name in ("distributed", "tensor"):
        r = out[name]
        stale_gap = (r["stale"] - r["learner"]).abs().max().item()
        synced_gap = (r["synced"] - r["learner"]).abs().max().item()
        print(f"{name}: stale gap {stale_gap:.2e}, synced gap {synced_gap:.2e}, {r['stats']}")
        assert stale_gap > 1e-2, f"{name}: the training step did not change the probe log-probs"
        assert synced_gap <= 1e-4, f"{name}: server differs from the learner after sync by {synced_gap}"
        assert r["stats"]["bytes"] > 0
    # FP8-rounded weights: the server equals transformers on the rounded weights, and differs from
    # the learner by the rounding's own mismatch.
    r = out["fp8"]
    r["hf_rounded"] = hf_logprobs(ckpt, r["rounded"], PROBE)
    fp8_gap = (r["synced"] - r["learner"]).abs().max().item()
    ref_gap = (r["synced"] - r["hf_rounded"]).abs().max().item()
    predicted = (r["hf_rounded"] - r["learner"]).abs().max().item()
    print(f"fp8: server vs learner {fp8_gap:.2e}, server vs transformers on rounded weights {ref_gap:.2e}, "
          f"rounded vs learner (independent) {predicted:.2e}")
    assert ref_gap <= 1e-4 and fp8_gap > 1e-3 and fp8_gap == pytest.approx(predicted, rel=0.05, abs=1e-4)
