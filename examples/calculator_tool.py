"""A tool-using episode: the model may call a calculator before it answers.

The task (recipe calculator_tool_cpu): "a+b%10=" for digits a, b; the answer is (a + b) mod 10,
which a tiny model trained from random weights hardly learns to compute. Every model turn is one
token:
  turn 1: a digit is the answer; any other token asks the calculator, which evaluates the
          question and appends its result: environment tokens, which the next turn reads and
          the loss does not train on;
  turn 2 (after a call): the answer; the model only has to copy the calculator's digit.
Reward: exact match of the final turn, set by the episode itself (data.reward is not asked).

Why "any other token" and not one dedicated call token: a random policy over 128 tokens would
try a dedicated token 1 time in 128, then fail to copy the result 127 times in 128; it learns to
guess digits first, and the call dies out before the copy is learned (measured). Here the random
policy calls ~90 % of the time, first learns to guess (calls fall to ~50 %), then learns the copy
and calls on every question.

    megatron-rl train calculator_tool_cpu
"""

import re

QUESTION = re.compile(r"([0-9+]+)%([0-9]+)=")


def calculate(question: str) -> str:
    """The calculator: "a+b%m=" in the text -> str((a + b) mod m)."""
    terms, modulo = QUESTION.search(question).groups()
    return str(sum(int(t) for t in terms.split("+")) % int(modulo))


async def generate(prompt, episode):
    """rollout.generate: one episode of `prompt` (megatron_rl/rollout/episode.py)."""
    turn = await episode.generate(max_new_tokens=1)
    if not turn.text.isdigit():  # not an answer: a call for the calculator
        episode.append_text(calculate(episode.tokenizer.decode(prompt.ids)))
        turn = await episode.generate(max_new_tokens=1)
    episode.reward = float(turn.text == prompt.answer)
