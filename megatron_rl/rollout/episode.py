"""Multi-turn and tool-using episodes: a user's episode function by import path (`rollout.generate`).

    async def my_episode(prompt: Prompt, episode: Episode) -> None:
        turn = await episode.generate()              # the model samples, given everything so far
        if turn.text == CALL:
            episode.append_text(run_tool(prompt))     # environment tokens: in the context, no loss
            await episode.generate()
        # optional: episode.reward = ...  (else data.reward scores the decoded response)

The trainer calls the function once per (prompt, sample), all of them concurrently, with a fresh
`Episode` holding the prompt. `episode.generate()` sends the episode's tokens so far to a server
through the trainer's `RolloutClient` (retries on another server, dead servers skipped; log-probs,
top-K and routed experts as the algorithm needs them) and appends the sampled turn;
`episode.append(ids)` / `append_text(text)` append tokens the model did not generate. The finished
episode is ONE `RolloutRecord`: `prompt_ids` the prompt, `response_ids` model turn 1 + environment
tokens + model turn 2 + ..., and `loss_mask` True on the model's tokens only.

Alignment (records.py's rule: row t of every per-token field belongs to the step that produced
`response_ids[t]`, input position P−1+t; `records.merge_segments` builds the record, the same
rule as a sample continued after an abort):
- model tokens: μ and top-K rows are the turn's own, as SGLang returned them;
- environment tokens: `loss_mask` False, μ 0, top-K ids −1 with log-probs 0 (what prompt rows hold
  in a batch: the learner drops negative ids, and the loss never reads the row);
- environment tokens' `versions` (per-token weight versions) are −1 (UNKNOWN_VERSION);
- `routes` covers every input position [0, P+T−1) as a partition over the turns (of one weight
  version; after a version change the newer version's rows win, merge_segments): turn k (whose
  request held the C_k tokens so far and which sampled T_k) gives the rows from the end of the
  previous turn's rows up to C_k+T_k−1 — the prefill of the tokens new to it (the previous turn's
  last token, the environment tokens since) and its own decoding steps; turn 1 also gives the
  prompt's rows.
  A request also returns rows of the earlier positions: SGLang keeps routes beside the KV cache
  entries (state_capturer/base.py indexes its host buffer by KV slot), so a prefix-cache hit
  returns the rows stored when the position was computed; an evicted prefix is recomputed, and
  then the turn that produced the log-probs (the earlier one) is the one whose rows are kept;
- environment tokens after the last model turn are dropped: no model token reads them.
The record's `finish_reason` is the last turn's (whether the final answer ended on its own: an
earlier turn that stops at its `max_new_tokens` is the protocol, not a truncation);
`weight_version` the turns' (when they differ — a server restarted mid-episode — all of them
joined by commas, which never equals the trainer's version, so the loop treats the episode as
stale); `temperature` the step's: every turn samples at it (the learner divides its logits by one
temperature), so a turn can change `max_new_tokens` and `stop_token_ids` only.

Rewards: with `episode.reward` left None the reward pool scores the decoded response (every token,
environment ones included) with `data.reward`; a float set there (e.g. from the environment's
state) is the sample's reward and the pool is not asked.

Seeds (rollout.seeded): turn k of sample j of the round's prompt i is sampled with seed
`base + i·n + j + k·TURN_SEED_STRIDE` (mod 2^31): turn 0 has the seed the single-turn path gives
that sample, later turns seeds of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Optional


from megatron_rl.plugins import load_object
from megatron_rl.rollout.client import GenerationAborted, RolloutClient, RolloutError, SamplingParams
from megatron_rl.rollout.records import RolloutRecord, merge_segments, same_layout

TURN_SEED_STRIDE = 1_000_003
"""Seed offset between an episode's turns (prime, far above any round's prompts × samples)."""


class EpisodeError(RuntimeError):
    """A user's episode function failed, or returned an episode that cannot be trained on."""


@dataclasses.dataclass
class Turn:
    """One model turn of an episode, as `Episode.generate` returns it."""

    ids: list[int]
    """The tokens the model sampled (its stop token included when it stopped on one)."""
    text: Optional[str]
    """Those tokens decoded (special tokens kept); None for an episode without a tokenizer."""
    finish_reason: str
    """"stop" (a stop token) or "length" (the turn's max_new_tokens)."""


Sampler = Callable[[list[int], int, Optional[int], Optional[list[int]]], Awaitable[RolloutRecord]]
"""`sampler(context_ids, turn_index, max_new_tokens, stop_token_ids)` → the turn's record."""


class Episode:
    """The builder of one episode's record: model turns and environment tokens, in order.

    The trainer hands one to the user's function with a sampler bound (`generate`); tests and
    other callers can build one from turn records directly (`add_turn`).
    """

    def __init__(self, prompt_ids: Sequence[int], *, tokenizer=None, sampler: Optional[Sampler] = None):
        self.prompt_ids: list[int] = [int(x) for x in prompt_ids]
        if not self.prompt_ids:
            raise ValueError("an episode needs a prompt of at least one token")
        self.response_ids: list[int] = []
        self.tokenizer = tokenizer
        self.reward: Optional[float] = None
        """Set it to score the episode yourself (the reward pool is then not asked)."""
        self._sampler = sampler
        self._turns: list[tuple[int, RolloutRecord]] = []  # (offset in the response, record)

    # -- state --------------------------------------------------------------------------------
    @property
    def ids(self) -> list[int]:
        """Every token so far (prompt + response): the context of the next turn."""
        return self.prompt_ids + self.response_ids

    @property
    def num_turns(self) -> int:
        return len(self._turns)

    @property
    def text(self) -> str:
        """The response so far, decoded (special tokens kept, as the reward function sees it)."""
        return self._decode(self.response_ids)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise RuntimeError("this Episode has no tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- building -----------------------------------------------------------------------------
    async def generate(self, max_new_tokens: Optional[int] = None,
                       stop_token_ids: Optional[Sequence[int]] = None) -> Turn:
        """Sample one model turn given every token so far, append it and return it.
        `max_new_tokens`: this turn's budget (default rollout.max_new_tokens, eval's in eval);
        `stop_token_ids`: extra tokens that end the turn (the model's EOS always does)."""
        if self._sampler is None:
            raise RuntimeError("this Episode has no sampler (it was not made by the trainer): add "
                               "turns with add_turn(record)")
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: a positive number of tokens")
        stops = None if stop_token_ids is None else [int(x) for x in stop_token_ids]
        record = await self._sampler(self.ids, len(self._turns), max_new_tokens, stops)
        return self.add_turn(record)

    def add_turn(self, record: RolloutRecord) -> Turn:
        """Append a sampled turn: `record` is one response to exactly `self.ids` (the client's
        record of that request, with its log-probs, top-K and routes)."""
        if record.loss_mask is not None:
            raise ValueError("a turn is one sampled response (its record has no loss_mask)")
        if record.prompt_ids.tolist() != self.ids:
            raise ValueError(f"turn {len(self._turns)}: its request held {record.prompt_ids.numel()} tokens "
                             f"that are not the episode's {len(self.ids)} tokens so far; a turn must "
                             "continue the episode")
        # Checked here as well as in merge_segments: the user's function gets the error at the
        # turn that caused it.
        if self._turns and not same_layout(self._turns[0][1], record):
            raise ValueError(f"turn {len(self._turns)} was sampled with another temperature, top-K "
                             "width, routes layout or versions presence than turn 0; an episode's "
                             "turns share them")
        self._turns.append((len(self.response_ids), record))
        ids = record.response_ids.tolist()
        self.response_ids += ids
        return Turn(ids, self._decode(ids) if self.tokenizer is not None else None, record.finish_reason)

    def append(self, ids: Sequence[int]) -> None:
        """Append tokens the model did not generate (a tool's output, a user turn): the next turn
        reads them; the loss does not train on them."""
        ids = list(ids)
        bad = [x for x in ids if isinstance(x, bool) or not isinstance(x, int) or x < 0]
        if bad:
            raise ValueError(f"environment tokens are token ids (ints ≥ 0); got {bad[:5]}")
        self.response_ids += ids

    def append_text(self, text: str) -> list[int]:
        """Append `text` tokenized without special tokens added; returns its ids."""
        if self.tokenizer is None:
            raise RuntimeError("this Episode has no tokenizer: append token ids with append(ids)")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.append(ids)
        return ids

    # -- the record ---------------------------------------------------------------------------
    def to_record(self, prompt_index: int, sample_index: int) -> RolloutRecord:
        """The episode as one RolloutRecord (environment tokens after the last turn dropped)."""
        if not self._turns:
            raise EpisodeError(f"episode (prompt {prompt_index}, sample {sample_index}) has no model "
                               "turn: the episode function must call episode.generate() at least once")
        off, last = self._turns[-1]
        T = off + last.response_ids.numel()  # the response ends with the last model turn
        return merge_segments(self.prompt_ids, self.response_ids[:T], self._turns, prompt_index=prompt_index,
                              sample_index=sample_index, always_mask=True)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def load_episode_fn(spec: str, key: str = "rollout.generate") -> Callable[..., Awaitable[Any]]:
    """The user's episode function a spec names; it must be async (it awaits episode.generate)."""
    fn = load_object(spec, key)
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise ValueError(f"{key}={spec!r}: {_name(fn)} is not an async function; write it as "
                         "`async def fn(prompt, episode)` (it awaits episode.generate())")
    return fn


async def sample_episodes(fn, client: RolloutClient, tokenizer, prompts: Sequence[Any], n: int,
                          sampling: SamplingParams, *, top_k: int = 0, routes: bool = False,
                          seed_index: Optional[Sequence[int]] = None,
                          on_record: Optional[Callable[[RolloutRecord, Optional[float]], Any]] = None,
                          ) -> tuple[list[list[RolloutRecord]], dict[tuple[int, int], float]]:
    """n episodes of each prompt (objects with `.ids`; the trainer's `Prompt`s), all concurrent:
    `fn(prompt, episode)` each. Returns (records[i][j], the rewards episodes set themselves by
    (i, j)). `on_record(record, reward_or_None)` is called as each episode finishes. `seed_index`:
    the prompts' indices in the round (seeds, module docstring); default their position. If one
    episode fails, the others are cancelled and the error is raised."""
    if routes and (client.moe_topk is None or client.num_experts is None):
        raise ValueError("routes need the client's moe_topk and num_experts")

    async def one(i: int, j: int) -> tuple[RolloutRecord, Optional[float]]:
        prompt = prompts[i]
        where = f"episode (prompt {i}{f' {prompt.uid}' if hasattr(prompt, 'uid') else ''}, sample {j})"
        base = (seed_index[i] if seed_index is not None else i) * n + j

        async def sampler(ids, turn, max_new_tokens, stop_token_ids):
            s = dataclasses.replace(
                sampling, max_new_tokens=sampling.max_new_tokens if max_new_tokens is None else max_new_tokens,
                stop_token_ids=stop_token_ids if stop_token_ids is not None else sampling.stop_token_ids,
                seed=None if sampling.seed is None else (sampling.seed + base + turn * TURN_SEED_STRIDE) % 2 ** 31)
            try:
                out = await client.generate([ids], s, n=1, top_k_logprobs=top_k, return_routed_experts=routes)
            except GenerationAborted:
                raise
            except RolloutError as e:
                raise RolloutError(f"{where} turn {turn}: {e}") from e
            return out[0][0]

        episode = Episode(prompt.ids, tokenizer=tokenizer, sampler=sampler)
        try:
            returned = await fn(prompt, episode)
        except (RolloutError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise EpisodeError(f"rollout.generate: {_name(fn)} raised on {where}: "
                               f"{type(e).__name__}: {e}") from e
        if returned is not None and returned is not episode:
            raise EpisodeError(f"rollout.generate: {_name(fn)} returned a {type(returned).__name__} on "
                               f"{where}; it fills the episode it is given and returns None")
        record = episode.to_record(i, j)
        reward = episode.reward
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise EpisodeError(f"rollout.generate: {where} set episode.reward = {reward!r}; a finite "
                                   "number, or None to have data.reward score the response")
            reward = float(reward)
        if on_record is not None:
            on_record(record, reward)
        return record, reward

    tasks = {(i, j): asyncio.ensure_future(one(i, j)) for i in range(len(prompts)) for j in range(n)}
    try:
        await asyncio.gather(*tasks.values())
    except BaseException:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        raise
    records = [[tasks[(i, j)].result()[0] for j in range(n)] for i in range(len(prompts))]
    own = {k: t.result()[1] for k, t in tasks.items() if t.result()[1] is not None}
    return records, own
