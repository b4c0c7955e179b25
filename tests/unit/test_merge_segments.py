"""records.merge_segments, the one merge rule of a response generated in segments (a sample
continued after an abort; an episode's turns): where every row of μ, top-K, versions, the loss
mask and the routes comes from. Segment records are built here with rows that name their segment
and position, so each row of the merged record traces back to its origin. The episode's own
assembly (one weight version: today's partition) is tests/unit/test_episode.py, unchanged."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.records import RolloutRecord, merge_segments

K, L, KR = 3, 2, 2  # top-K width, MoE layers, router top-k
PROMPT = [1, 40, 41, 13]
P = len(PROMPT)


def segment(context, response, *, tag, version="3", finish="abort", temperature=0.7, versions=True):
    """The record a server returns for `response` sampled after `context` under weights
    `version`: μ −(tag + (t+1)/100), top-K column 1 = 90 + tag, routes row p = (tag, p) for every
    input position 0..C+T−2 (SGLang returns all of them, routed_experts_start_len=0)."""
    C, T = len(context), len(response)
    t = torch.arange(T, dtype=torch.float32)
    routes = torch.zeros(C + T - 1, L, KR, dtype=torch.uint8)
    routes[:, :, 0] = tag
    routes[:, :, 1] = torch.arange(C + T - 1, dtype=torch.uint8)[:, None]
    v = int(version) if version.isdigit() else -1
    return RolloutRecord(
        prompt_index=0, sample_index=0, prompt_ids=torch.tensor(context), response_ids=torch.tensor(response),
        rollout_logp=-(tag + (t + 1) / 100),
        topk_ids=torch.stack([torch.tensor([response[r], 90 + tag, 100 + r]) for r in range(T)]).int(),
        topk_logp=torch.stack([-(tag + (t + 1) / 100), -t - 5, -t - 6], dim=1).float(),
        routes=routes, finish_reason=finish, weight_version=version, temperature=temperature,
        versions=torch.full((T,), v, dtype=torch.int32) if versions else None)


def continued(lengths, versions, finish="length"):
    """A sample cut into segments of `lengths` tokens (each an abort but the last), versions by segment."""
    response, segs = [], []
    for k, (n, v) in enumerate(zip(lengths, versions)):
        toks = [50 + len(response) + i for i in range(n)]
        segs.append((len(response), segment(PROMPT + response, toks, tag=k + 1, version=v,
                                            finish=finish if k == len(lengths) - 1 else "abort")))
        response += toks
    return response, segs


def owners(rec):
    """Per input position: (segment tag, the position the row had in that segment's routes)."""
    return [tuple(r) for r in rec.routes[:, 0, :].tolist()]


def test_continuation_one_version_rows_and_partition():
    response, segs = continued([3, 2], ["3", "3"])
    rec = merge_segments(PROMPT, response, segs, prompt_index=4, sample_index=1)
    assert rec.response_ids.tolist() == [50, 51, 52, 53, 54] and rec.prompt_ids.tolist() == PROMPT
    assert torch.allclose(rec.rollout_logp, torch.tensor([-1.01, -1.02, -1.03, -2.01, -2.02]))
    assert rec.topk_ids[:, 1].tolist() == [91, 91, 91, 92, 92] and rec.topk_ids[:, 0].tolist() == response
    assert torch.equal(rec.topk_logp[:, 0], rec.rollout_logp)
    assert rec.versions.tolist() == [3] * 5 and rec.versions.dtype == torch.int32
    assert rec.loss_mask is None  # no environment token
    # Routes: segment 1 gives the prompt and its own steps, input positions 0..P+3−2; segment 2
    # the prefill of segment 1's last token (position P+2) and its own steps. Every row keeps its
    # position.
    N = P + 5 - 1
    assert owners(rec) == [(1, p) for p in range(P + 2)] + [(2, p) for p in range(P + 2, N)]
    assert (rec.finish_reason, rec.weight_version, rec.temperature) == ("length", "3", 0.7)
    assert (rec.prompt_index, rec.sample_index) == (4, 1)
    assert rec.oldest_version == 3


def test_continuation_across_a_weight_update_takes_the_newest_versions_routes():
    response, segs = continued([3, 2], ["3", "4"])
    rec = merge_segments(PROMPT, response, segs, prompt_index=0, sample_index=0)
    assert rec.versions.tolist() == [3, 3, 3, 4, 4] and rec.oldest_version == 3
    assert rec.weight_version == "3,4"  # never one trainer version
    # μ stays each segment's own (the anchor of each token), but every route row is version 4's:
    # segment 2 re-prefilled the prompt and segment 1's tokens under the new weights.
    assert torch.allclose(rec.rollout_logp, torch.tensor([-1.01, -1.02, -1.03, -2.01, -2.02]))
    assert owners(rec) == [(2, p) for p in range(P + 4)]


def test_newest_version_first_segment_then_partition():
    """Versions 3, 4, 4: segment 2 (the first of version 4) gives every position it covers,
    segment 3 the positions after; segment 1's rows are unused."""
    response, segs = continued([2, 3, 2], ["3", "4", "4"])
    rec = merge_segments(PROMPT, response, segs, prompt_index=0, sample_index=0)
    assert rec.versions.tolist() == [3, 3, 4, 4, 4, 4, 4]
    e2 = P + 5 - 1  # segment 2's input positions: the prompt and 2 + 3 response tokens, less the last
    assert owners(rec) == [(2, p) for p in range(e2)] + [(3, p) for p in range(e2, P + 7 - 1)]
    assert rec.weight_version == "3,4"


def test_unknown_version_never_outranks_a_step():
    """A segment from a restarted server ("default": version −1) keeps only the positions no
    step-versioned segment covers."""
    response, segs = continued([2, 3], ["5", "default"])
    rec = merge_segments(PROMPT, response, segs, prompt_index=0, sample_index=0)
    assert rec.versions.tolist() == [5, 5, -1, -1, -1] and rec.oldest_version == -1
    assert owners(rec) == [(1, p) for p in range(P + 1)] + [(2, p) for p in range(P + 1, P + 4)]
    assert rec.weight_version == "5,default"


def test_environment_rows_and_masks():
    """Two turns around environment tokens, across a weight update: environment rows hold μ 0,
    top-K −1 / 0, version −1 and loss_mask False; routes are version 4's (turn 2 read them all)."""
    t1 = segment(PROMPT, [50, 51], tag=1, version="3", finish="stop")
    context = PROMPT + [50, 51, 60, 61]
    t2 = segment(context, [52], tag=2, version="4", finish="stop")
    response = [50, 51, 60, 61, 52]
    rec = merge_segments(PROMPT, response, [(0, t1), (4, t2)], prompt_index=0, sample_index=0)
    assert rec.loss_mask.tolist() == [True, True, False, False, True]
    assert torch.allclose(rec.rollout_logp, torch.tensor([-1.01, -1.02, 0, 0, -2.01]))
    assert rec.topk_ids[:, 0].tolist() == [50, 51, -1, -1, 52] and (rec.topk_logp[2:4] == 0).all()
    assert rec.versions.tolist() == [3, 3, -1, -1, 4] and rec.oldest_version == 3  # env rows not read
    assert owners(rec) == [(2, p) for p in range(P + 4)]
    # One version: the partition (turn 1 through its own steps, turn 2 from turn 1's last token).
    t2 = segment(context, [52], tag=2, version="3")
    rec = merge_segments(PROMPT, response, [(0, t1), (4, t2)], prompt_index=0, sample_index=0)
    assert owners(rec) == [(1, p) for p in range(P + 1)] + [(2, p) for p in range(P + 1, P + 4)]
    # An episode asks for the mask even when every token is the model's.
    rec = merge_segments(PROMPT, [50, 51], [(0, t1)], prompt_index=0, sample_index=0, always_mask=True)
    assert rec.loss_mask.tolist() == [True, True]


def test_finish_reason_override_and_records_without_versions_or_routes():
    response, segs = continued([3, 2], ["3", "3"], finish="abort")
    rec = merge_segments(PROMPT, response, segs, prompt_index=0, sample_index=0, finish_reason="stop")
    assert rec.finish_reason == "stop"
    assert merge_segments(PROMPT, response, segs, prompt_index=0, sample_index=0).finish_reason == "abort"
    a = segment(PROMPT, [50], tag=1, versions=False)
    a.routes = a.topk_ids = a.topk_logp = None
    b = segment(PROMPT + [50], [51], tag=2, versions=False)
    b.routes = b.topk_ids = b.topk_logp = None
    rec = merge_segments(PROMPT, [50, 51], [(0, a), (1, b)], prompt_index=0, sample_index=0)
    assert rec.versions is None and rec.routes is None and rec.topk_ids is None
    assert torch.allclose(rec.rollout_logp, torch.tensor([-1.01, -2.01]))


def test_bad_segments_are_refused():
    response, segs = continued([3, 2], ["3", "3"])
    kw = dict(prompt_index=2, sample_index=1)
    with pytest.raises(ValueError, match=r"merge_segments \(prompt 2, sample 1\): no segment"):
        merge_segments(PROMPT, [], [], **kw)
    with pytest.raises(ValueError, match="segment 1 starts at response offset 2, inside the previous"):
        merge_segments(PROMPT, response, [segs[0], (2, segs[1][1])], **kw)
    with pytest.raises(ValueError, match=r"segment 1's 2 tokens are not response_ids\[3:5\]"):
        merge_segments(PROMPT, response[:3] + [99, 54], segs, **kw)
    with pytest.raises(ValueError, match="segment 0's request held 4 tokens that are not the prompt"):
        merge_segments([1, 40, 41, 14], response, segs, **kw)
    with pytest.raises(ValueError, match="has 6 tokens but the last segment ends at 5"):
        merge_segments(PROMPT, response + [70], segs, **kw)
    other = segment(PROMPT + response[:3], response[3:], tag=2, temperature=1.0)
    with pytest.raises(ValueError, match="segment 1 was sampled with another temperature"):
        merge_segments(PROMPT, response, [segs[0], (3, other)], **kw)
    other = segment(PROMPT + response[:3], response[3:], tag=2, versions=False)
    with pytest.raises(ValueError, match="versions presence"):
        merge_segments(PROMPT, response, [segs[0], (3, other)], **kw)
    empty = RolloutRecord(prompt_index=0, sample_index=0, prompt_ids=torch.tensor(PROMPT + response[:3]),
                          response_ids=torch.zeros(0, dtype=torch.int64), rollout_logp=torch.zeros(0),
                          topk_ids=None, topk_logp=None, routes=None, finish_reason="abort",
                          weight_version="3", temperature=0.7)
    with pytest.raises(ValueError, match="segment 1 has no token"):
        merge_segments(PROMPT, response[:3], [segs[0], (3, empty)], **kw)


def test_a_continued_turn_counts_as_its_newest_version():
    """An episode turn that was itself continued across a push (weight_version "3,4", routes of
    version 4) followed by a version-4 turn: one version, so the partition."""
    response, segs = continued([2, 1], ["3", "4"])
    turn1 = merge_segments(PROMPT, response, segs, prompt_index=0, sample_index=0)
    assert turn1.weight_version == "3,4" and turn1.versions.tolist() == [3, 3, 4]
    context = PROMPT + response + [60]
    turn2 = segment(context, [61, 62], tag=9, version="4")
    rec = merge_segments(PROMPT, response + [60, 61, 62], [(0, turn1), (4, turn2)], prompt_index=0,
                         sample_index=0, always_mask=True)
    e1 = P + 3 - 1
    assert owners(rec) == [(2, p) for p in range(e1)] + [(9, p) for p in range(e1, P + 6 - 1)]
    assert rec.versions.tolist() == [3, 3, 4, -1, 4, 4] and rec.weight_version == "3,4"
    assert rec.loss_mask.tolist() == [True] * 3 + [False] + [True] * 2
