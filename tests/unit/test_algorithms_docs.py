"""docs/algorithms.md embeds the worked table of the two motivating cases; it must match what the
library computes now."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.algorithms.worked_examples import markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"
BEGIN = "<!-- BEGIN worked-examples (generated; do not edit by hand) -->\n"
END = "<!-- END worked-examples -->"


def test_worked_table_in_docs_matches_library():
    text = DOC.read_text()
    assert BEGIN in text and END in text
    embedded = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert embedded == markdown(), (
        "docs/algorithms.md is stale: regenerate with python -m megatron_rl.algorithms.worked_examples")


def test_worked_table_tells_the_papers_story():
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in markdown().splitlines()
            if line.startswith("| ") and " | " in line}
    # columns: rare ↑ A>0, rare ↑ A<0, dominant ↓ A<0, dominant ↓ A>0
    assert rows["PPO clip ε=0.2"][0] == "**masked**" and "masked" not in rows["PPO clip ε=0.2"][2]
    assert "masked" not in rows["DPPO binary TV δ=0.15"][0]
    assert rows["DPPO binary TV δ=0.15"][2] == "**masked**"
    assert rows["DPPO binary KL δ=0.05"][2] == "**masked**"
    for rule in ("DPPO binary TV δ=0.15", "DPPO binary KL δ=0.05"):
        assert "masked" not in rows[rule][1] and "masked" not in rows[rule][3].rstrip(" |")
