"""A producer whose groups all went elsewhere holds an empty batch; the exchange (`rebalance`, real
gloo point-to-point between two processes) must still give it its share, field for field: the empty
batch's schema (per-sequence dtypes, top-K width) is its peers'."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed

K = 3


def make_records(n: int):
    from megatron_rl.rollout.records import RolloutRecord

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        T = 2 + 3 * i
        ids = torch.randint(3, 50, (T,), generator=g)
        topk = torch.randint(3, 50, (T, K), generator=g).to(torch.int32)
        topk[:, 0] = ids.to(torch.int32)  # the sampled token among μ's top-K, each id once
        topk[:, 1], topk[:, 2] = (ids + 1).to(torch.int32), (ids + 2).to(torch.int32)
        out.append(RolloutRecord(
            prompt_index=i // 2, sample_index=i % 2, prompt_ids=torch.randint(3, 50, (4,), generator=g),
            response_ids=ids, rollout_logp=-torch.rand(T, generator=g), topk_ids=topk,
            topk_logp=torch.log_softmax(torch.randn(T, K, generator=g), -1),
            routes=None, finish_reason="length" if i % 3 else "stop", weight_version="0", temperature=1.0))
    return out


def worker(rank, world_size):
    import torch.distributed as dist

    from megatron_rl.batch import RolloutBatch, rebalance

    recs = make_records(6) if rank == 0 else []
    batch = RolloutBatch.from_records(recs, [float(i % 2) for i in range(len(recs))],
                                      group_ids=[i // 2 for i in range(len(recs))], mini_batch=[0] * len(recs),
                                      pad_id=0, with_topk=True, top_k=K, with_versions=True)
    assert batch.schema() == RolloutBatch.from_records(
        make_records(1), [0.0], group_ids=[0], mini_batch=[0], pad_id=0, with_topk=True,
        with_versions=True).schema()
    new, stats = rebalance(batch, dist.group.WORLD, 1)
    return {"seq": {k: v.tolist() for k, v in new.seq.items()},
            "tok": {k: [t.tolist() for t in v] for k, v in new.tok.items()}, "stats": stats}


@pytest.mark.slow
def test_an_empty_producer_receives_its_share_whole():
    r0, r1 = run_distributed(worker, 2, timeout=300)
    assert r1["stats"]["moved_sequences"] > 0 and len(r0["seq"]["seq_len"]) + len(r1["seq"]["seq_len"]) == 6
    from megatron_rl.batch import RolloutBatch

    recs = make_records(6)
    ref = RolloutBatch.from_records(recs, [float(i % 2) for i in range(6)], group_ids=[i // 2 for i in range(6)],
                                    mini_batch=[0] * 6, pad_id=0, with_topk=True, with_versions=True)
    got = {}
    for r in (r0, r1):
        for j, ids in enumerate(r["tok"]["input_ids"]):
            got[tuple(ids)] = {k: r["tok"][k][j] for k in r["tok"]} | {k: r["seq"][k][j] for k in r["seq"]}
    assert len(got) == 6
    for i in range(6):
        row = got[tuple(ref.tok["input_ids"][i].tolist())]
        for k in ref.tok:
            assert row[k] == ref.tok[k][i].tolist(), k
        for k in ref.seq:
            assert row[k] == ref.seq[k][i].tolist(), k
    assert any(row["truncated"] is True for row in got.values())  # booleans arrive as booleans
