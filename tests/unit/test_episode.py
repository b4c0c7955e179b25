"""Episode assembly (rollout/episode.py) from turn records built here: where every row of μ, the
loss mask, top-K and the routes comes from, what the rollout batch makes of it, and the errors a
user's episode function gets. The same assembly against a real SGLang server and the learner:
tests/e2e/test_custom_generate.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.rollout.episode import Episode, EpisodeError, load_episode_fn, sample_episodes
from megatron_rl.rollout.records import RolloutRecord
from megatron_rl import batch as batching

K, L, KR = 3, 2, 2  # top-K width, MoE layers, router top-k


def turn(context, response, *, tag, finish="length", version="3", temperature=0.7):
    """The record a server would return for `response` sampled after `context`: log-probs,
    top-K and routes filled with values that name the turn (`tag`) and the row, so that every
    row of the episode can be traced back. Routes cover all C+T−1 input positions, as SGLang's
    do (routed_experts_start_len=0), and hold the turn's tag everywhere, including the prompt
    positions an earlier turn also returned."""
    C, T = len(context), len(response)
    t = torch.arange(T, dtype=torch.float32)
    topk_ids = torch.stack([torch.tensor([response[r], 90 + tag, 100 + r]) for r in range(T)]).int()
    return RolloutRecord(
        prompt_index=0, sample_index=0, prompt_ids=torch.tensor(context), response_ids=torch.tensor(response),
        rollout_logp=-(tag + (t + 1) / 100), topk_ids=topk_ids,
        topk_logp=torch.stack([-(tag + (t + 1) / 100), -t - 5, -t - 6], dim=1).float(),
        routes=torch.full((C + T - 1, L, KR), tag, dtype=torch.uint8),
        finish_reason=finish, weight_version=version, temperature=temperature)


PROMPT = [1, 40, 41, 13]


def three_turns():
    """model 2 tokens, env 3, model 1, env 2, model 2, env 4 (trailing): P = 4."""
    ep = Episode(PROMPT)
    ep.add_turn(turn(ep.ids, [50, 51], tag=1))
    ep.append([60, 61, 62])
    ep.add_turn(turn(ep.ids, [52], tag=2))
    ep.append([63, 64])
    ep.add_turn(turn(ep.ids, [53, 54], tag=3, finish="stop"))
    ep.append([65, 66, 67, 68])
    return ep


def test_episode_record_rows_line_up():
    ep = three_turns()
    rec = ep.to_record(prompt_index=5, sample_index=2)
    P = len(PROMPT)
    # The trailing environment tokens feed no model token: dropped.
    assert rec.response_ids.tolist() == [50, 51, 60, 61, 62, 52, 63, 64, 53, 54]
    model = [True, True, False, False, False, True, False, False, True, True]
    assert rec.loss_mask.tolist() == model
    # μ: each model row is its turn's own row; environment rows 0.
    expect_logp = [-1.01, -1.02, 0, 0, 0, -2.01, 0, 0, -3.01, -3.02]
    assert torch.allclose(rec.rollout_logp, torch.tensor(expect_logp))
    # top-K: the turn's rows, the sampled token forced in; environment rows -1 / 0.
    assert rec.topk_ids[:, 0].tolist() == [50, 51, -1, -1, -1, 52, -1, -1, 53, 54]
    assert (rec.topk_ids[~rec.loss_mask] == -1).all() and (rec.topk_logp[~rec.loss_mask] == 0).all()
    assert torch.equal(rec.topk_logp[rec.loss_mask][:, 0], rec.rollout_logp[rec.loss_mask])
    # Routes: P+T−1 input positions, a partition over the turns. Turn 1: the prompt and its own
    # steps, positions 0..P+2−2; turn 2: the prefill of turn 1's last token and the 3 environment
    # tokens, then its own step; turn 3 likewise. The rows a later turn also returned for earlier
    # positions are not used.
    assert rec.routes.shape == (P + 10 - 1, L, KR)
    # Turn 1: rows 0..4 (inputs 1 40 41 13 50; row 4 produced 51); turn 2: rows 5..8 (inputs
    # 51 60 61 62; row 8 produced 52); turn 3: rows 9..12 (inputs 52 63 64 53).
    owner = rec.routes[:, 0, 0].tolist()
    assert owner == [1] * 5 + [2] * 4 + [3] * 4
    # Each response token's row: the step that produced it (model tokens) or the next turn's
    # prefill (environment tokens).
    by_token = owner[P - 1:]
    assert by_token == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert rec.finish_reason == "stop" and rec.weight_version == "3" and rec.temperature == 0.7
    assert (rec.prompt_index, rec.sample_index) == (5, 2)


def test_batch_honours_the_episode_mask():
    """from_records: the loss mask and μ of the learner's layout are the episode's; top-K rows of
    the environment pass the distinct-ids check; routes go through unchanged."""
    rec = three_turns().to_record(0, 0)
    single = turn(PROMPT, [50, 51, 52], tag=4)  # an ordinary record beside it: unchanged path
    b = batching.RolloutBatch.from_records([rec, single], [1.0, 0.0], group_ids=[0, 0], mini_batch=[0, 0],
                                           pad_id=0, with_topk=True, with_routes=True, num_experts=8)
    mb = b.micro_batch(torch.arange(2), 14)
    P = len(PROMPT)
    rows = torch.arange(P - 1, P - 1 + 10)
    assert torch.equal(mb["loss_mask"][0, rows], rec.loss_mask.float())
    assert mb["loss_mask"][0].sum() == 5 and mb["loss_mask"][0, :P - 1].sum() == 0
    assert torch.equal(mb["rollout_logp"][0, rows], torch.where(rec.loss_mask, rec.rollout_logp, 0.0))
    assert torch.equal(mb["labels"][0, rows], rec.response_ids)
    assert torch.equal(mb["topk_ids"][0, rows], rec.topk_ids.long())
    assert torch.equal(mb["routed_experts"][0, :P + 9], rec.routes)
    assert mb["loss_mask"][1].nonzero().flatten().tolist() == [3, 4, 5]
    # The outcome reward sits on the last model token (the response ends with one).
    assert batching.token_rewards(mb)[0].nonzero().flatten().tolist() == [P - 1 + 9]


def test_weight_versions_and_no_model_turn():
    ep = Episode(PROMPT)
    ep.add_turn(turn(ep.ids, [50], tag=1, version="3"))
    ep.append([60])
    ep.add_turn(turn(ep.ids, [51], tag=2, version="4"))
    # Turns from two weight versions (a server restarted mid-episode): never the trainer's version.
    assert ep.to_record(0, 0).weight_version == "3,4"
    empty = Episode(PROMPT)
    empty.append([60, 61])
    with pytest.raises(EpisodeError, match="no model turn"):
        empty.to_record(1, 2)


def test_turns_must_continue_the_episode():
    ep = Episode(PROMPT)
    ep.add_turn(turn(ep.ids, [50], tag=1))
    with pytest.raises(ValueError, match="must continue the episode"):
        ep.add_turn(turn(PROMPT, [51], tag=2))
    with pytest.raises(ValueError, match="another temperature"):
        ep.add_turn(turn(ep.ids, [51], tag=2, temperature=1.0))
    with pytest.raises(ValueError, match="token ids"):
        ep.append([1, -2])
    with pytest.raises(RuntimeError, match="no sampler"):
        asyncio.run(ep.generate())
    with pytest.raises(ValueError, match="loss_mask must be"):
        RolloutRecord(prompt_index=0, sample_index=0, prompt_ids=torch.tensor([1]), response_ids=torch.tensor([2, 3]),
                      rollout_logp=torch.zeros(2), topk_ids=None, topk_logp=None, routes=None,
                      finish_reason="stop", weight_version="0", temperature=1.0, loss_mask=torch.ones(3, dtype=torch.bool))


class _Prompt:
    ids, answer, uid = (1, 2, 3), "7", "synthetic:4"


@pytest.mark.parametrize("body, match", [
    ("raise KeyError('x')", r"raised on episode \(prompt 0 synthetic:4, sample \d\): KeyError: 'x'"),
    ("return 3", "returned a int .* it fills the episode it is given"),
    ("pass", r"episode \(prompt 0, sample \d\) has no model turn"),
])
def test_episode_function_errors_name_the_sample(tmp_path, body, match):
    f = tmp_path / "episodes.py"
    f.write_text(f"async def fn(prompt, episode):\n    {body}\n\ndef sync(prompt, episode):\n    pass\n")
    fn = load_episode_fn(f"{f}:fn")
    with pytest.raises(EpisodeError, match=match):
        # No turn is generated before the failure: no client is needed.
        asyncio.run(sample_episodes(fn, None, None, [_Prompt()], 2, None))
    with pytest.raises(ValueError, match="not an async function"):
        load_episode_fn(f"{f}:sync")


def test_episode_rewards_of_its_own():
    """An episode's own reward goes to on_record and back, the pool's part stays None; a reward that
    is not a finite number is refused, naming the sample."""
    seen = []

    async def fn(prompt, episode):
        episode.add_turn(turn(episode.ids, [50], tag=1))
        episode.reward = 0.5 if prompt.answer == "7" else None

    class Other(_Prompt):
        answer = "8"

    records, own = asyncio.run(sample_episodes(fn, None, None, [_Prompt(), Other()], 2, None,
                                               on_record=lambda rec, r: seen.append((rec.prompt_index, r))))
    assert own == {(0, 0): 0.5, (0, 1): 0.5}
    assert sorted(seen, key=str) == sorted([(0, 0.5), (0, 0.5), (1, None), (1, None)], key=str)
    assert [[r.sample_index for r in g] for g in records] == [[0, 1], [0, 1]]

    async def bad(prompt, episode):
        episode.add_turn(turn(episode.ids, [50], tag=1))
        episode.reward = float("nan")

    with pytest.raises(EpisodeError, match=r"set episode.reward = nan"):
        asyncio.run(sample_episodes(bad, None, None, [_Prompt()], 1, None))


def test_validate_resolves_rollout_generate():
    """The config check (dry-run) loads the episode function and refuses what episodes cannot do."""
    from pathlib import Path

    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.trainer.preflight import validate

    example = Path(__file__).resolve().parents[2] / "examples" / "calculator_tool.py"
    validate(to_object(load_config("calculator_tool_cpu", [f"rollout.generate={example}:generate"])))
    with pytest.raises(ValueError, match="calculate is not an async function"):
        validate(to_object(load_config("calculator_tool_cpu", [f"rollout.generate={example}:calculate"])))
    with pytest.raises(ValueError, match="overlong_buffer .* several turns"):
        validate(to_object(load_config("calculator_tool_cpu", [f"rollout.generate={example}:generate",
                                                               "algorithm.overlong_buffer=1"])))
