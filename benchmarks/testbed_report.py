"""The testbed comparison's tables and figures, from the run directories `megatron-rl compare` made.

    .venv/bin/python benchmarks/testbed_report.py runs/testbed/dense runs/testbed/moe \
        --figures docs/figures --out runs/testbed/report.md

Writes, per comparison directory: accuracy curves with min-max bands over seeds (train accuracy and
the trust region's masked fraction), and a markdown report with
- results: steps to the target accuracy (per seed), final (mean of the last 5 steps) and best
  train accuracy, held-out mean@k at the end, collapse events (compare.collapse_events: ≥ 5
  consecutive steps more than 0.3 below the run's best so far), the train/inference mismatch;
- the trust region's masked and clipped fractions per μ bucket and advantage sign (the trainer's
  diagnostics, averaged over steps and seeds);
- the token-level analysis of the DPPO paper's two motivating cases on real training tokens
  (trainer.token_log_every): for every logged token the two rules are evaluated on the same
  (μ, π, A): PPO's ratio clip (ε_low 0.2, ε_high 0.28) stops it iff A>0 and π/μ > 1.28 or A<0 and
  π/μ < 0.8; DPPO's binary TV (δ 0.15) stops it iff A>0 and π−μ > 0.15 or A<0 and μ−π > 0.15.
  Beside them CPPO's rule (ALGORITHMS.md §12) on the same tokens, each logged sequence scanned whole:
  binary TV, δ 0.15, w_min 0.8, δ_b 0.02 calibrated per response, the horizon the run's
  rollout.max_new_tokens; its stops and those only its prefix budget makes.
  Tables by μ bucket and the tokens each rule alone stops, with their context.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.tools.compare import summarize  # noqa: E402
from megatron_rl.run.metrics import read_metrics  # noqa: E402

EPS_LOW, EPS_HIGH, DELTA = 0.2, 0.28, 0.15
BUCKETS = (("μ < 0.1", 0.0, 0.1), ("0.1 ≤ μ ≤ 0.9", 0.1, 0.9 + 1e-9), ("μ > 0.9", 0.9 + 1e-9, 1.01))


def methods_of(cmp_dir: Path) -> dict[str, list[Path]]:
    summary = json.loads((cmp_dir / "summary.json").read_text())
    return {label: [cmp_dir / label / f"seed{s}" for s in summary["seeds"]] for label in summary["methods"]}


def fmt(x, spec=".2f") -> str:
    return "–" if x is None else format(x, spec)


def results_table(runs: dict[str, list[Path]], target: float) -> str:
    lines = [f"| method | steps to {target:.2f} (per seed) | final | best | held-out mean@k | collapses | mismatch |",
             "|---|---|---|---|---|---|---|"]
    for label, dirs in runs.items():
        s = [summarize(d, target) for d in dirs]
        mean = lambda k: sum(x[k] for x in s if x[k] is not None) / max(1, sum(x[k] is not None for x in s))  # noqa: E731
        finals = " / ".join(f"{x['final']:.2f}" for x in s)
        lines.append(f"| {label} | {' / '.join('–' if x['steps_to_target'] is None else str(x['steps_to_target']) for x in s)} "
                     f"| {mean('final'):.2f} ({finals}) | {mean('best'):.2f} | {fmt(mean('eval_final'))} "
                     f"| {sum(x['collapses'] for x in s)} | {fmt(mean('mismatch'), '.4f')} |")
    return "\n".join(lines)


def fraction_table(runs: dict[str, list[Path]]) -> str:
    """masked (and clipped) fraction per advantage sign x μ bucket, averaged over steps and seeds."""
    splits = [f"{a}/{m}" for a in ("adv_pos", "adv_neg") for m in ("mu_lt_0.1", "mu_0.1_0.9", "mu_gt_0.9")]
    head = ["A>0, μ<0.1", "A>0, mid", "A>0, μ>0.9", "A<0, μ<0.1", "A<0, mid", "A<0, μ>0.9"]
    lines = ["| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for label, dirs in runs.items():
        cells = []
        for sp in splits:
            vals = defaultdict(list)
            for d in dirs:
                for m in read_metrics(d):
                    if m["step"] < 0:
                        continue
                    for ind in ("masked", "clipped"):
                        if f"{ind}_frac/{sp}" in m and m.get(f"token_frac/{sp}", 0) > 0:
                            vals[ind].append(m[f"{ind}_frac/{sp}"])
            mk = sum(vals["masked"]) / len(vals["masked"]) if vals["masked"] else None
            cl = sum(vals["clipped"]) / len(vals["clipped"]) if vals["clipped"] else None
            cells.append(f"{fmt(mk, '.3f')}" + (f" (c {cl:.3f})" if cl else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_tokens(dirs: list[Path]) -> list[dict]:
    """Every logged mini-batch of the runs, as flat per-token tensors with their sequence index."""
    out = []
    for d in dirs:
        for f in sorted((d / "tokens").glob("step*.pt")):
            rec = torch.load(f, weights_only=True)
            for mb_index, mb in enumerate(rec["mini_batches"]):
                for part in mb:
                    pos = part["loss_mask"].nonzero()
                    out.append({"run": d, "step": rec["step"], "mini_batch": mb_index, **part,
                                "row": pos[:, 0], "col": pos[:, 1]})
    return out


def rules(mu: torch.Tensor, pi: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(PPO clip stops, binary-TV stops) per token (see the module docstring)."""
    r = pi / mu
    ppo = ((adv > 0) & (r > 1 + EPS_HIGH)) | ((adv < 0) & (r < 1 - EPS_LOW))
    tv = ((adv > 0) & (pi - mu > DELTA)) | ((adv < 0) & (mu - pi > DELTA))
    return ppo, tv


def cppo_stops(parts: list[dict], horizon: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(CPPO binary-TV stops, of them those only the prefix budget makes) per token, in the order of
    the parts' flat tensors; each part's sequences scanned whole (see the module docstring)."""
    from megatron_rl.algorithms.cppo import cppo_loss

    stops, budget = [], []
    for p in parts:
        m = p["loss_mask"].bool()

        def rows(x):
            out = torch.zeros(m.shape, dtype=torch.float64)
            out[m] = x.double()
            return out

        _, metrics = cppo_loss(rows(p["logp"]), rows(p["rollout_logp"]), rows(p["advantages"]),
                               response_mask=m, delta=DELTA, w_min=0.8, delta_b=0.02, calibrate=True,
                               horizon=horizon)
        stops.append(metrics["masked"][m])
        budget.append(metrics["cppo_budget_masked"][m])
    return torch.cat(stops), torch.cat(budget)


def max_new_tokens(run: Path) -> int:
    import yaml

    return int(yaml.safe_load((run / "config.yaml").read_text())["rollout"]["max_new_tokens"])


def token_analysis(runs: dict[str, list[Path]], tokenizer) -> str:
    lines = ["| method | tokens | bucket | share | PPO-clip stops | TV stops | both | PPO only | TV only | "
             "CPPO stops | CPPO budget only | mean |π−μ| of PPO-only | mean π/μ of TV-only |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    picked = {"ppo": [], "tv": []}
    for label, dirs in runs.items():
        parts = load_tokens(dirs)
        if not parts:
            continue
        mu = torch.cat([p["rollout_logp"] for p in parts]).double().exp()
        pi = torch.cat([p["logp"] for p in parts]).double().exp()
        adv = torch.cat([p["advantages"] for p in parts]).double()
        ppo, tv = rules(mu, pi, adv)
        cppo, cppo_budget = cppo_stops(parts, max_new_tokens(dirs[0]))
        n = len(mu)
        for name, lo, hi in BUCKETS:
            b = (mu >= lo) & (mu < hi)
            k = int(b.sum())
            if not k:
                continue
            po, to = b & ppo & ~tv, b & tv & ~ppo
            lines.append(
                f"| {label} | {n} | {name} | {k / n:.3f} | {int((b & ppo).sum()) / k:.4f} | {int((b & tv).sum()) / k:.4f} "
                f"| {int((b & ppo & tv).sum()) / k:.4f} | {int(po.sum()) / k:.4f} | {int(to.sum()) / k:.4f} "
                f"| {int((b & cppo).sum()) / k:.4f} | {int((b & cppo_budget).sum()) / k:.4f} "
                f"| {fmt((pi - mu)[po].abs().mean().item() if po.any() else None, '.3f')} "
                f"| {fmt((pi / mu)[to].mean().item() if to.any() else None, '.3f')} |")
        # examples: the extreme tokens each rule alone stops (largest ratio / largest mass shift),
        # one per advantage sign; a group's samples are often the same text: distinct ones only
        offsets = torch.tensor([0] + [len(p["logp"]) for p in parts]).cumsum(0)
        for kind, sel, score in (("ppo", ppo & ~tv, (pi / mu).log().abs()), ("tv", tv & ~ppo, (pi - mu).abs())):
            for sign in (adv > 0, adv < 0):
                idx = (sel & sign).nonzero()[:, 0]
                seen = set()
                for i in idx[score[idx].argsort(descending=True)].tolist():
                    if len(seen) == 1:
                        break
                    j = int(torch.searchsorted(offsets, i, right=True)) - 1
                    p, t = parts[j], i - int(offsets[j])
                    row, col = int(p["row"][t]), int(p["col"][t])
                    ids = p["input_ids"][row].tolist()
                    resp = p["loss_mask"][row].nonzero()[:, 0]
                    start, end = int(resp[0]), int(resp[-1])
                    text = (tokenizer.decode(ids[start + 1:col + 1]) + "⟦" + tokenizer.decode(ids[col + 1:col + 2])
                            + "⟧" + tokenizer.decode(ids[col + 2:end + 2]))
                    prompt = tokenizer.decode(ids[:start + 1]).split("user\n")[-1].split("<|im_end|>")[0]
                    if (prompt, text) in seen:
                        continue
                    seen.add((prompt, text))
                    picked[kind].append(f"| {label} | step {p['step']} mb {p['mini_batch']} | `{prompt}` | `{text}` "
                                        f"| {mu[i]:.4f} | {pi[i]:.4f} | {pi[i] / mu[i]:.2f} | {adv[i]:+.2f} |")
    ex_head = "| method | where | prompt | response (⟦token⟧) | μ | π | π/μ | A |\n|---|---|---|---|---|---|---|---|"
    return ("\n".join(lines) + "\n\nTokens only ratio clipping stops (largest |log π/μ| per method and "
            "advantage sign):\n\n" + ex_head + "\n" + "\n".join(picked["ppo"])
            + "\n\nTokens only TV stops (largest |π−μ| per method and advantage sign):\n\n"
            + ex_head + "\n" + "\n".join(picked["tv"]))


def plots(name: str, runs: dict[str, list[Path]], figures: Path) -> list[Path]:
    from megatron_rl.tools.plot import plot_compare

    figures.mkdir(parents=True, exist_ok=True)
    out = [plot_compare(runs, figures / f"testbed_{name}_accuracy.png"),
           plot_compare(runs, figures / f"testbed_{name}_masked.png", key="masked_frac"),
           plot_compare(runs, figures / f"testbed_{name}_entropy.png", key="entropy/mean")]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("comparisons", nargs="+", help="compare output directories")
    p.add_argument("--figures", default="docs/figures")
    p.add_argument("--out", default=None, help="the markdown report (default: stdout)")
    p.add_argument("--target", type=float, default=None, help="default: each comparison's own")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from megatron_rl.models.tiny import build_char_tokenizer

    parts = []
    for cmp_dir in map(Path, args.comparisons):
        summary = json.loads((cmp_dir / "summary.json").read_text())
        runs = methods_of(cmp_dir)
        target = args.target or summary["target"]
        figs = plots(cmp_dir.name, runs, Path(args.figures))
        first = next(iter(runs.values()))[0]
        tok_dir = first / "tiny_model"
        tokenizer = AutoTokenizer.from_pretrained(tok_dir) if tok_dir.exists() else build_char_tokenizer()
        parts.append(f"## {cmp_dir.name}: `{summary['recipe']}`, {len(summary['seeds'])} seeds x {summary['steps']} steps, "
                     f"{summary['wall_s'] / 60:.0f} min\n\nShared overrides: `{' '.join(summary['shared_overrides'])}`; "
                     "one hyperparameter trial per method.\n\n"
                     + "\n".join(f"![{f.stem}](figures/{f.name})" for f in figs)
                     + f"\n\n### Results\n\n{results_table(runs, target)}\n\n"
                     f"### Masked fraction (clipped: c) per advantage sign and μ bucket\n\n{fraction_table(runs)}\n\n"
                     f"### Which tokens each rule stops (logged training tokens)\n\n{token_analysis(runs, tokenizer)}\n")
    text = "\n".join(parts)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
