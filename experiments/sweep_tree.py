"""Sweep DDTree's tree budget and block size (depth) with the shipped checkpoints.

    python experiments/sweep_tree.py --prompts humaneval --limit 16 --out out/sweep
    python experiments/sweep_tree.py --limit 2 --budgets 1 4 16 --block-sizes 4 16 \\
        --max-new-tokens 32 --prompts test          # CPU smoke run

For each temperature: AR once, and per block size the DFlash chain plus DDTree at every
budget. All prompts of one run go BATCHED through `generate`, one call per prompt-length
bucket (prompts right-padded to multiples of 128 tokens, with prompt_lengths), so a run
compiles once per bucket. Each call is timed after a warm-up call of the same shapes;
tokens/s is therefore batched throughput (batch = the prompts of a bucket).

Per run it records tau (sum of accept_lengths / sum of rounds), tokens/s and the
histogram of acceptance lengths 1..block_size over the active rounds. Temperature > 0
samples with a fixed key (--seed). Writes to --out: sweep.csv, sweep.json (rows plus
histograms), tau_vs_budget.png, tokens_per_s_vs_budget.png, accept_hist.png,
ddtree_vs_dflash.png; prints a table at the end. --replot redraws the PNGs from sweep.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

import _args
import jax
import numpy as np
from tqdm import tqdm

from ddtree_jax import compile_cache
from ddtree_jax.evaluation import Totals, bucket, fresh_programs, prompt_set, time_call
from ddtree_jax.generate import generate
from ddtree_jax.shipped import load_shipped
from ddtree_jax.tree import check_tree_temperature

BUCKET = 128
CSV_FIELDS = (
    "temperature",
    "method",
    "block_size",
    "budget",
    "tree_temperature",
    "prompts",
    "tau",
    "tokens_per_s",
    "rounds",
    "tokens",
    "seconds",
    "device",
)
HIST_BUDGETS = (16, 64)  # accept_hist.png: DFlash chain vs DDTree at these budgets ...
HIST_BLOCK = 16  # ... at this block size, T=0 (nearest available config otherwise)


def run_one(shipped, groups, args, temperature, method, block_size, budget) -> dict:
    """One sweep point: every bucket warmed up, then timed; totals, tau and the histogram."""
    kw = dict(
        method=method,
        tree_budget=budget,
        tree_temperature=args.tree_temperature,
        block_size=block_size,
        max_new_tokens=args.max_new_tokens,
        temperature=temperature,
        key=jax.random.key(args.seed),
        stop_token_ids=None if args.stop else (),
        numerics=args.numerics,
    )
    drafter = None if method == "ar" else shipped.drafter
    hist_len = 1 if method == "ar" else block_size
    totals = Totals()
    for ids, lengths in groups:
        seconds, res = time_call(
            lambda ids=ids, n=lengths: generate(shipped.target, drafter, ids, prompt_lengths=n, **kw)
        )
        totals.add(res, seconds, hist_len)
    hist, outside = totals.histogram, totals.outside
    if outside:
        tqdm.write(f"warning: {method} block {block_size} budget {budget}: {outside} rounds accepted 0 or > block")
    return {
        "temperature": temperature,
        "method": method,
        "block_size": block_size,
        "budget": budget,
        "tree_temperature": args.tree_temperature if method == "ddtree" else None,
        **totals.row(),
        "device": args.device,
        "accept_hist": hist.tolist(),  # index i: rounds that accepted i + 1 tokens
        "accept_outside": outside,
    }


# ----------------------------------------------------------------------------------
# Plots


def _find(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def _style(block_sizes):
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("viridis")
    n = max(len(block_sizes) - 1, 1)
    return {bs: cmap(0.85 * i / n) for i, bs in enumerate(block_sizes)}


def _vs_budget(rows, args, key, ylabel, path, ar_reference):
    import matplotlib.pyplot as plt

    temps, colors = args.temperatures, _style(args.block_sizes)
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for bs in args.block_sizes:
            pts = sorted(_find(rows, temperature=t, method="ddtree", block_size=bs), key=lambda r: r["budget"])
            if pts:
                ax.plot(
                    [r["budget"] for r in pts],
                    [r[key] for r in pts],
                    "o-",
                    color=colors[bs],
                    label=f"DDTree, block {bs} (depth {bs - 1})",
                )
            for r in _find(rows, temperature=t, method="dflash", block_size=bs):
                ax.axhline(r[key], color=colors[bs], ls="--", lw=1.2, label=f"DFlash chain, block {bs}")
        if ar_reference:
            for r in _find(rows, temperature=t, method="ar"):
                ax.axhline(r[key], color="black", ls=":", lw=1.5, label="AR")
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.budgets, [str(b) for b in args.budgets])
        ax.minorticks_off()
        ax.set_xlabel("tree budget (nodes, root not counted)")
        ax.set_title(f"T={t:g}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(
        f"{ylabel} vs tree budget\n({args.prompts} prompts, {args.max_new_tokens} new tokens, {args.dtype})",
        fontsize=10,
    )
    legend = {}  # one legend for all panels, below them: it never hides a line
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, h)
    ncol = min(len(legend), 4)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=max(ncol, 1), fontsize=9)
    rows_of_legend = -(-len(legend) // max(ncol, 1))
    fig.tight_layout(rect=(0, 0.05 + 0.05 * rows_of_legend, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _hist_plot(rows, args, path):
    import matplotlib.pyplot as plt

    t = 0.0 if 0.0 in args.temperatures else args.temperatures[0]
    bs = HIST_BLOCK if HIST_BLOCK in args.block_sizes else max(args.block_sizes)
    budgets = sorted(set(args.budgets))
    chosen = [b for b in HIST_BUDGETS if b in budgets] or budgets[-2:]
    series = [("DFlash chain", r) for r in _find(rows, temperature=t, method="dflash", block_size=bs)]
    series += [
        (f"DDTree budget {b}", r)
        for b in chosen
        for r in _find(rows, temperature=t, method="ddtree", block_size=bs, budget=b)
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = np.arange(1, bs + 1)
    width = 0.8 / max(len(series), 1)
    for i, (label, r) in enumerate(series):
        h = np.asarray(r["accept_hist"], float)
        ax.bar(
            x + (i - (len(series) - 1) / 2) * width, h / max(h.sum(), 1), width, label=f"{label} (tau {r['tau']:.2f})"
        )
    ax.set_xticks(x)
    ax.set_xlabel("tokens accepted per round (drafts + bonus)")
    ax.set_ylabel("fraction of rounds")
    ax.set_title(f"Acceptance lengths, block {bs}, T={t:g} ({args.prompts} prompts)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bars_plot(rows, args, path):
    import matplotlib.pyplot as plt

    temps = args.temperatures
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4.5), sharey=True, squeeze=False)
    x = np.arange(len(args.block_sizes))
    for ax, t in zip(axes[0], temps, strict=True):
        chain, best, best_budget = [], [], []
        for bs in args.block_sizes:
            c = _find(rows, temperature=t, method="dflash", block_size=bs)
            chain.append(c[0]["tau"] if c else np.nan)
            d = _find(rows, temperature=t, method="ddtree", block_size=bs)
            top = max(d, key=lambda r: r["tau"]) if d else None
            best.append(top["tau"] if top else np.nan)
            best_budget.append(top["budget"] if top else None)
        chain_bars = ax.bar(x - 0.2, chain, 0.4, label="DFlash chain", color="tab:gray")
        bars = ax.bar(x + 0.2, best, 0.4, label="DDTree, best budget", color="tab:blue")
        ax.bar_label(chain_bars, fmt="%.2f", fontsize=8)
        labels = [f"{v:.2f}\nB={b}" if b is not None else "" for v, b in zip(best, best_budget, strict=True)]
        ax.bar_label(bars, labels, fontsize=8)
        ax.set_xticks(x, [f"block {bs} (depth {bs - 1})" for bs in args.block_sizes])
        ax.set_title(f"T={t:g}")
        ax.grid(alpha=0.3, axis="y")
        ymax = np.nanmax([*chain, *best, 1.0])
        ax.set_ylim(0, max(ax.get_ylim()[1], ymax * 1.35))
        ax.legend(loc="upper center", ncol=2)
    axes[0][0].set_ylabel("tau (tokens per round)")
    fig.suptitle(f"DFlash chain vs best-budget DDTree ({args.prompts} prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_all(rows, args) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    paths = {name: os.path.join(args.out, name) for name in ("tau_vs_budget.png", "tokens_per_s_vs_budget.png")}
    _vs_budget(rows, args, "tau", "tau (tokens per round)", paths["tau_vs_budget.png"], ar_reference=False)
    _vs_budget(rows, args, "tokens_per_s", "tokens/s", paths["tokens_per_s_vs_budget.png"], ar_reference=True)
    paths["accept_hist.png"] = os.path.join(args.out, "accept_hist.png")
    _hist_plot(rows, args, paths["accept_hist.png"])
    paths["ddtree_vs_dflash.png"] = os.path.join(args.out, "ddtree_vs_dflash.png")
    _bars_plot(rows, args, paths["ddtree_vs_dflash.png"])
    return list(paths.values())


# ----------------------------------------------------------------------------------


def print_table(rows) -> None:
    ar = {r["temperature"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    print("| T | method | block | budget | tau | tokens/s | vs AR | rounds | tokens | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base = ar.get(r["temperature"])
        speed = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(
            f"| {r['temperature']:g} | {r['method']} | {r['block_size'] or '-'} | {r['budget'] or '-'} | "
            f"{r['tau']:.2f} | {r['tokens_per_s']:.1f} | {speed} | {r['rounds']} | {r['tokens']} | {r['seconds']:.3f} |"
        )


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", default=None, help="folder with target/, drafter/, tokenizer.json")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--numerics", default=None, help="exact or fast (default: generate's for the dtype)")
    ap.add_argument("--prompts", default="humaneval", choices=("humaneval", "test"))
    ap.add_argument("--limit", type=int, default=16, help="use the first N prompts (0 = all)")
    ap.add_argument("--data", default="data", help="prepared data folder (test split, HumanEval fallback)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16], help="tree depth = block size - 1")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument(
        "--tree-temperature", type=float, default=1.0, help="DDTree's drafter logits / this before the tree (> 0)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="PRNG seed of the sampled (T > 0) runs")
    ap.add_argument("--stop", action="store_true", help="stop rows at the end-of-text token (default: never)")
    ap.add_argument(
        "--one-call", action="store_true", help="pad all prompts to the widest bucket: one call (compile) per run"
    )
    ap.add_argument("--no-ar", action="store_true", help="skip the AR reference runs")
    ap.add_argument("--no-dflash", action="store_true", help="skip the DFlash chain runs")
    ap.add_argument("--out", default="out/sweep")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNGs and table from OUT/sweep.json")
    args = ap.parse_args(argv)
    if args.limit < 0:
        ap.error(f"--limit must be >= 0, got {args.limit}")
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        check_tree_temperature(args.tree_temperature)
    except ValueError:
        ap.error(f"--tree-temperature must be finite and > 0, got {args.tree_temperature}")
    _args.budgets(ap, args.budgets)
    bad = [t for t in args.temperatures if not (math.isfinite(t) and t >= 0)]  # nan passed `t < 0`
    if bad:
        ap.error(f"temperatures must be finite and >= 0, got {bad}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):  # os.makedirs failed after the load
        ap.error(f"--out {args.out!r} is a file, not a folder")
    args.budgets = sorted(set(args.budgets))
    args.block_sizes = sorted(set(args.block_sizes))
    args.temperatures = sorted(set(args.temperatures))
    return ap, args


def replot(out: str) -> None:
    """Redraws the PNGs and the table of an earlier sweep from its sweep.json."""
    path = os.path.join(out, "sweep.json")
    if not os.path.exists(path):
        sys.exit(f"error: no {path} to replot")
    with open(path) as f:
        saved = json.load(f)
    args = argparse.Namespace(**{**saved["args"], "out": out, "device": saved["device"]})
    print_table(saved["rows"])
    print("wrote " + ", ".join(plot_all(saved["rows"], args)))


def save_rows(rows: list[dict], args) -> None:
    """Writes OUT/sweep.csv and OUT/sweep.json (rows plus histograms)."""
    with open(os.path.join(args.out, "sweep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        meta = {k: v for k, v in vars(args).items() if k not in ("device", "replot")}
        json.dump({"device": args.device, "args": meta, "rows": rows}, f, indent=1)


def main(argv=None) -> None:
    ap, args = parse_args(argv)
    if args.replot:
        replot(args.out)
        return
    try:
        shipped = load_shipped(args.checkpoints, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    own = shipped.drafter.config.block_size
    bad = [b for b in args.block_sizes if not 2 <= b <= own]
    if bad:
        ap.error(f"block sizes must lie in [2, the drafter's block_size={own}], got {bad}")
    prompts = prompt_set(args.prompts, shipped.tokenizer, args.data, args.limit)
    if not prompts:
        sys.exit("error: no prompts")
    groups = bucket(prompts, BUCKET, args.one_call)
    args.device = f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"
    print(
        f"device {args.device}; dtype {args.dtype}; {len(prompts)} {args.prompts} prompts in buckets "
        f"{[(ids.shape[1], ids.shape[0]) for ids, _ in groups]} (width, prompts); "
        f"target {shipped.target.config.num_params() / 1e6:.1f}M params, drafter block {own}"
    )

    runs = []
    for t in args.temperatures:
        if not args.no_ar:
            runs.append((t, "ar", None, None))
        for bs in args.block_sizes:
            if not args.no_dflash:
                runs.append((t, "dflash", bs, None))
            runs += [(t, "ddtree", bs, b) for b in args.budgets]
    rows = []
    os.makedirs(args.out, exist_ok=True)
    bar = tqdm(runs, desc="sweep", unit="run")
    for t, method, bs, budget in bar:
        bar.set_postfix_str(f"T={t:g} {method} block={bs or '-'} budget={budget or '-'}")
        fresh_programs()  # each point as a process of its own would time it
        rows.append(run_one(shipped, groups, args, t, method, bs, budget))
        save_rows(rows, args)  # after every run: a sweep cut short keeps what it measured
    bar.close()
    pngs = plot_all(rows, args)

    print(
        f"\n{args.prompts} prompts: {len(prompts)}, max_new_tokens {args.max_new_tokens}, {args.dtype}, "
        f"{args.device}; tokens/s is batched throughput"
    )
    print_table(rows)
    print(f"\nwrote {args.out}/sweep.csv, sweep.json, " + ", ".join(os.path.basename(p) for p in pngs))


if __name__ == "__main__":
    compile_cache.enable()
    main()
