"""`megatron-rl data NAME... --out DIR`: public math sets -> the layout the recipes read.

Every set becomes `DIR/<name>.parquet` in DAPO-Math-17k's (verl's) layout, which
configs/data/dapo_math.yaml and configs/paper/dppo_table1.yaml read (`$MRL_DATA/<name>.parquet`):

    {"data_source": NAME, "prompt": [{"role": "user", "content": PROMPT}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": ANSWER}, "extra_info": {"index": i, "id": ...}}

PROMPT is DAPO's template around the problem, the one DAPO-Math-17k's own prompts carry and the
DPPO paper trains and evaluates with (its AIME avg@32 uses the training prompt):

    Solve the following math problem step by step. The last line of your response should be of the
    form Answer: $Answer (without quotes) where $Answer is the answer to the problem.

    {problem}

    Remember to put your answer on its own line after "Answer:".

The `math` reward (math-verify) reads the response's final answer, boxed or on that last line.

Sources are the hub datasets below, fetched through huggingface_hub's cache (HF_HUB_OFFLINE=1: the
cache only, e.g. filled once on a login node with `hf download --repo-type dataset ID`):

| name            | hub dataset                      | fields read                         | rows |
|-----------------|----------------------------------|-------------------------------------|------|
| dapo-math-17k   | BytedTsinghua-SIA/DAPO-Math-17k  | prompt, reward_model.ground_truth   | 17,398 unique prompts (the file repeats each ~100x; kept once) |
| aime-2024       | HuggingFaceH4/aime_2024          | problem, answer (id)                | 30 |
| aime-2025       | opencompass/AIME2025             | question, answer (I and II)         | 30 |
| gsm8k-train     | openai/gsm8k (main, train split) | question, answer after "####"       | 7,473 |
| gsm8k-test      | openai/gsm8k (main, test split)  | question, answer after "####"       | 1,319 |
| math-500        | HuggingFaceH4/MATH-500           | problem, answer (unique_id)         | 500 |

A source row without its problem or answer is an error naming the file, row and field; nothing is
dropped silently (DAPO-Math-17k's repeats are counted in the summary line).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_rl.data.datasets import DataError

DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of "
                 "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
                 "{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")


@dataclasses.dataclass(frozen=True)
class Source:
    repo: str  # hub dataset id
    patterns: tuple[str, ...]  # its files to read (fnmatch, relative to the snapshot)
    convert: Callable[[dict, str], tuple[str, str, Any]]  # row, where -> (prompt text, answer, id)
    dedupe: bool = False


def _field(row: dict, path: str, where: str) -> Any:
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            raise DataError(f"{where}: field '{path}' is missing")
        node = node[part]
    return node


def _text(row: dict, path: str, where: str) -> str:
    v = _field(row, path, where)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str) or not v.strip():
        raise DataError(f"{where}: field '{path}': expected non-empty text, got {v!r:.60}")
    return v.strip()


def _dapo(row: dict, where: str):
    prompt = _field(row, "prompt", where)
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[-1], dict) or not prompt[-1].get("content"):
        raise DataError(f"{where}: field 'prompt': expected a list of chat messages")
    return prompt[-1]["content"], _text(row, "reward_model.ground_truth", where), (row.get("extra_info") or {}).get("index")


def _gsm8k_answer(text: str, where: str) -> str:
    if "####" not in text:
        raise DataError(f"{where}: field 'answer': no '#### <number>' final line")
    return text.rsplit("####", 1)[1].strip().replace(",", "")


SOURCES: dict[str, Source] = {
    "dapo-math-17k": Source("BytedTsinghua-SIA/DAPO-Math-17k", ("*.parquet",), _dapo, dedupe=True),
    "aime-2024": Source("HuggingFaceH4/aime_2024", ("*.parquet", "*.jsonl"),
                        lambda r, w: (_text(r, "problem", w), _text(r, "answer", w), r.get("id"))),
    "aime-2025": Source("opencompass/AIME2025", ("*.jsonl", "*.parquet"),
                        lambda r, w: (_text(r, "question", w), _text(r, "answer", w), None)),
    "gsm8k-train": Source("openai/gsm8k", ("main/train-*.parquet",),
                          lambda r, w: (_text(r, "question", w), _gsm8k_answer(_text(r, "answer", w), w), None)),
    "gsm8k-test": Source("openai/gsm8k", ("main/test-*.parquet",),
                         lambda r, w: (_text(r, "question", w), _gsm8k_answer(_text(r, "answer", w), w), None)),
    "math-500": Source("HuggingFaceH4/MATH-500", ("test.jsonl", "*.parquet"),
                       lambda r, w: (_text(r, "problem", w), _text(r, "answer", w), r.get("unique_id"))),
}


def _rows(path: Path) -> Iterator[tuple[int, dict]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
        return
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: row {i}: not valid JSON ({e.msg})") from None


def source_files(root: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The files of the first pattern that matches anything (sorted: split shards in order)."""
    for pattern in patterns:
        found = sorted(p for p in root.glob(pattern if "/" in pattern else f"**/{pattern}") if p.is_file())
        if found:
            return found
    raise FileNotFoundError(f"{root}: no file matching {', '.join(patterns)}")


def convert(name: str, out_dir: Path, root: Optional[Path] = None) -> tuple[Path, str]:
    """Write out_dir/<name>.parquet from source `name` (its hub snapshot, or `root`); return the
    path and a summary line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if name not in SOURCES:
        raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(SOURCES)}")
    src = SOURCES[name]
    if root is None:
        from megatron_rl.models.hub import snapshot

        root = snapshot(src.repo, f"dataset {src.repo}", repo_type="dataset", allow_patterns=src.patterns)
    rows, seen, repeats = [], set(), 0
    files = source_files(root, src.patterns)
    for path in files:
        for i, row in _rows(path):
            problem, answer, ident = src.convert(row, f"{path}: row {i}")
            key = (problem, answer)
            if src.dedupe and key in seen:
                repeats += 1
                continue
            seen.add(key)
            prompt = problem if name == "dapo-math-17k" else DAPO_TEMPLATE.format(problem=problem)
            rows.append({"data_source": name, "prompt": [{"role": "user", "content": prompt}], "ability": "math",
                         "reward_model": {"style": "rule", "ground_truth": answer},
                         "extra_info": {"index": len(rows), "id": None if ident is None else str(ident)}})
    if not rows:
        raise DataError(f"{name}: no rows in {', '.join(map(str, files))}")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.parquet"
    tmp = out.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, out)
    extra = f" ({repeats} repeated rows kept once)" if repeats else ""
    return out, f"{name}: {len(rows)} prompts{extra} from {src.repo} -> {out}"


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="megatron-rl data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="+", metavar="NAME", help=f"{', '.join(SOURCES)}, or all")
    p.add_argument("--out", default=os.environ.get("MRL_DATA", "data"),
                   help="folder to write NAME.parquet into (default: $MRL_DATA, else ./data: where the recipes look)")
    args = p.parse_args(argv)
    names = list(SOURCES) if args.names == ["all"] else args.names
    for name in names:
        if name not in SOURCES:
            raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(SOURCES)}, all")
    for name in names:
        print(convert(name, Path(args.out))[1], flush=True)
    return 0

