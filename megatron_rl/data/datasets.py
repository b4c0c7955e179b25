"""Prompt datasets: JSONL or Parquet rows -> typed prompts, with errors that name file, row and field.

The default layout is DAPO-Math-17k's (also verl's): each row has `prompt` — a list of chat
messages `{"role", "content"}` — and `reward_model.ground_truth`; `data_source` names the reward
function family. Other layouts map their fields with dotted paths (`messages_field`,
`answer_field`), or use a plain-text prompt field (`text_field`), which becomes one user message.
Rows are validated when loaded, so a malformed row fails before any rollout starts, and nothing
read so far is silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence


class DataError(ValueError):
    """A malformed data row: the message names the file, the row (1-based) and the field."""


@dataclass(frozen=True)
class PromptExample:
    messages: tuple[dict, ...]  # chat messages, each {"role": str, "content": str}
    answer: str  # ground truth the reward compares against
    source: str  # data_source (reward family hint), "" when absent
    origin: str  # "file:row" — where this example came from (1-based row)


def _get(row: Any, path: str) -> Any:
    node = row
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(part)
        node = node[part]
    return node


def _rows_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: row {i}: not valid JSON ({e.msg} at column {e.colno})") from None


def _rows_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for i, row in enumerate(table.to_pylist(), start=1):
        yield i, row


def _messages(raw: Any, where: str, field: str) -> tuple[dict, ...]:
    if hasattr(raw, "tolist"):  # numpy arrays from some Parquet readers
        raw = raw.tolist()
    if not isinstance(raw, (list, tuple)) or not raw:
        raise DataError(f"{where}: field '{field}': expected a non-empty list of chat messages, "
                        f"got {type(raw).__name__}")
    out = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: field '{field}[{j}]': expected {{'role': str, 'content': str}}, got {m!r:.80}")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def load_prompts(
    path: str | Path,
    *,
    messages_field: Optional[str] = "prompt",
    text_field: Optional[str] = None,
    answer_field: Optional[str] = "reward_model.ground_truth",
    source_field: str = "data_source",
    limit: Optional[int] = None,
) -> list[PromptExample]:
    """Read every row of a .jsonl / .parquet file into PromptExamples (all rows validated)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.suffix == ".jsonl":
        rows = _rows_jsonl(path)
    elif path.suffix == ".parquet":
        rows = _rows_parquet(path)
    else:
        raise DataError(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl or .parquet")
    out = []
    for i, row in rows:
        where = f"{path}: row {i}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object, got {type(row).__name__}")
        try:
            if text_field:
                field = text_field
                text = _get(row, text_field)
                if not isinstance(text, str) or not text:
                    raise DataError(f"{where}: field '{field}': expected a non-empty string")
                messages = ({"role": "user", "content": text},)
            else:
                field = messages_field
                messages = _messages(_get(row, messages_field), where, messages_field)
            field = answer_field
            # No answer field: prompts scored by a learned reward model only (RLHF).
            answer = _get(row, answer_field) if answer_field else None
        except KeyError:
            raise DataError(f"{where}: field '{field}' is missing") from None
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if answer_field is None:
            answer = ""
        elif not isinstance(answer, str) or not answer.strip():
            raise DataError(f"{where}: field '{answer_field}': expected a non-empty string answer, "
                            f"got {answer!r:.80}")
        source = row.get(source_field, "") if isinstance(row.get(source_field, ""), str) else ""
        out.append(PromptExample(messages, answer, source, f"{path}:{i}"))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{path}: no rows")
    return out


def render_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of the chat-formatted prompt, ending with the assistant turn's opening."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
