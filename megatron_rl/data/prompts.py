"""Prompt sources for the trainer: the synthetic task or JSONL/Parquet files, as a resumable stream.

`PromptStream` walks a fixed list of examples in an order reshuffled every epoch by a seeded RNG;
its whole state is (epoch, index), saved in checkpoints, so a resumed run draws exactly the prompts
the uninterrupted run would have drawn.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config.schema import DataConfig
from megatron_rl.data.datasets import PromptExample, load_prompts, render_prompt
from megatron_rl.data.synthetic import as_prompt_examples, make_problems, task_kwargs


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]  # chat-formatted prompt token ids
    answer: str  # ground truth for the reward
    uid: str  # where it came from (file:row or synthetic:i)


def load_examples(data: DataConfig, split: str, num_eval: int = 0) -> list[PromptExample]:
    """Train or eval examples; checks every file (and row) up front."""
    if data.source == "synthetic":
        s = data.synthetic
        n = s.num_train if split == "train" else num_eval
        seed = s.seed if split == "train" else s.seed + 1
        return as_prompt_examples(make_problems(n, seed=seed, **task_kwargs(s)))
    if data.source != "files":
        raise ValueError(f"data.source={data.source!r}; valid: synthetic, files")
    files = data.train_files if split == "train" else data.eval_files
    if split == "train" and not files:
        raise ValueError("data.source=files needs data.train_files")
    out: list[PromptExample] = []
    for f in files:
        out += load_prompts(f, messages_field=data.messages_field, text_field=data.text_field,
                            answer_field=data.answer_field)
    return out[:num_eval] if split == "eval" and num_eval else out


def check_data_files(data: DataConfig) -> None:
    """Fail fast (dry-run, launchers) when a configured dataset file is missing."""
    for f in list(data.train_files) + list(data.eval_files):
        if not Path(f).exists():
            raise FileNotFoundError(f"dataset {f} does not exist (data.train_files / data.eval_files)")


def tokenize(examples: list[PromptExample], tokenizer) -> list[Prompt]:
    return [Prompt(tuple(render_prompt(tokenizer, e.messages)), e.answer, e.origin) for e in examples]


class TokenizedPrompts(Sequence):
    """`tokenize(examples, tokenizer)`, each prompt rendered when it is first drawn.

    A run draws prompts_per_step x steps prompts (each producer its share), often a fraction of the
    dataset: rendering every chat template up front cost ~3.5 s per process for 20k prompts, before
    the first step, on every rank and at every restart. Thread-safe (a producer thread draws while
    the main thread may too); a rendered prompt is kept for later epochs.
    """

    def __init__(self, examples: list[PromptExample], tokenizer):
        self.examples, self.tokenizer = examples, tokenizer
        self._rendered: dict[int, Prompt] = {}
        self._lock = threading.Lock()  # one fast tokenizer is not safe to call from two threads

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Prompt:
        p = self._rendered.get(i)
        if p is None:
            e = self.examples[i]
            with self._lock:
                p = self._rendered[i] = Prompt(tuple(render_prompt(self.tokenizer, e.messages)), e.answer, e.origin)
        return p


class PromptStream:
    def __init__(self, prompts: Sequence[Prompt], seed: int):
        if not prompts:
            raise ValueError("no training prompts")
        self.prompts, self.seed = prompts, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)
