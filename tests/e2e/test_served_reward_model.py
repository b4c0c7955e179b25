"""A reward model served by SGLang on CPU (`--is-embedding`, /classify) against HF transformers'
`Qwen3ForSequenceClassification` on the same tiny checkpoint; a server killed mid-request loses no
score.

Before patches/sglang_fixes.py, every served score was off by one constant (SGLang's score head
had a bias the checkpoint does not have, left at its random init): −0.113 here, far above 1e-5.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.models.tiny_reward import make_tiny_reward_checkpoint
from megatron_rl.rollout.client import RolloutClient

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from megatron_rl.rollout.server import EngineManager, ServerConfig

    root = tmp_path_factory.mktemp("served_rm")
    ckpt = make_tiny_reward_checkpoint(root / "rm", vocab_size=128)
    cfg = ServerConfig(model_path=str(ckpt), max_total_tokens=4096, extra_args=("--is-embedding",))
    with EngineManager(cfg, 2, log_dir=root / "logs") as mgr:
        yield ckpt, mgr


def sequences(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 99, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def hf_scores(ckpt, seqs) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0, 0].item() for s in seqs]


def test_served_scores_equal_hf(served):
    ckpt, mgr = served
    seqs = sequences(10, seed=0)

    async def go():
        async with RolloutClient(mgr) as client:
            return await client.classify(seqs, chunk=3)  # 4 chunks, over both servers

    got, ref = asyncio.run(go()), hf_scores(ckpt, seqs)
    print("max |SGLang - HF|:", max(abs(a - b) for a, b in zip(got, ref)))
    assert len(got) == len(seqs)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               rtol=0, atol=1e-5)


def test_killed_server_loses_no_score(served):
    ckpt, mgr = served
    victim = mgr.servers[0]
    seqs = sequences(64, seed=1)

    async def go():
        async with RolloutClient(mgr, backoff_initial=0.2) as client:
            victim.kill()  # SIGKILL: chunks sent to it fail and go to the other server
            return await client.classify(seqs, chunk=4), client.retry_events

    got, events = asyncio.run(go())
    assert any(e.url == victim.url for e in events), events
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(hf_scores(ckpt, seqs), dtype=torch.float64), rtol=0, atol=1e-5)
