"""Bench reports: the one schema of `bench.py` (and of `bench_pipeline.py`) rendered as Markdown,
JSON or CSV, and a plot. JSON holds every record as it is; CSV, one row a run, has every column of
the schema, in its order, whichever methods ran; a Markdown table shows the columns that have a
value for the methods run."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import List

from .bench import CATEGORY_COLUMNS, ROW_COLUMNS, SUMMARY_COLUMNS, per_category
from .errors import UserError


# -- rendering: one schema, three formats -------------------------------------------------------

def _md_cell(value) -> str:
    return "n/a" if value is None else str(value)  # None: undefined (an sd of one repeat), JSON's null


def shown_columns(records: List[dict], columns: List[str]) -> List[str]:
    """The schema's columns that hold a value in at least one record, in the schema's order. A
    column no method fills (another method's figures) is left out; None is a value (n/a:
    undefined, such as the sd of one repeat) and stays."""
    return [c for c in columns if any(c in r and r[c] != "" for r in records)]


def _md_table(records: List[dict], columns: List[str]) -> str:
    columns = shown_columns(records, columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for record in records:
        lines.append("| " + " | ".join(_md_cell(record.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def _rounded(record: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}


def render(result: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(dict(result, per_category=[_rounded(t) for t in per_category(result)]), indent=2) + "\n"
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=ROW_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
        return out.getvalue()
    if fmt == "md":
        env = ", ".join(f"{k}: {v}" for k, v in result["environment"].items())
        params = ", ".join(f"{k}: {v}" for k, v in result["params"].items())
        return "\n\n".join([
            "## Environment", env, "## Parameters", params,
            "## Summary", _md_table(result["summary"], SUMMARY_COLUMNS),
            "## Per category", _md_table([_rounded(t) for t in per_category(result)], CATEGORY_COLUMNS),
            "## Per prompt", _md_table(result["rows"], ROW_COLUMNS),
        ]) + "\n"
    raise UserError(f"unknown format {fmt!r} (choose md, json or csv)")


def print_summary(result: dict, stream=None) -> None:
    print(_md_table(result["summary"], SUMMARY_COLUMNS), file=stream or sys.stderr)  # sys.stderr as it is at the call


# -- plot: which method wins where ----------------------------------------------------------------

def plot_bench(result: dict, path: Path) -> Path:
    """Two grouped bar charts (decode tok/s; speed-up over ar) by prompt category, one bar per
    method config, written as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'mlx-specdec[plot]'") from None
    table = per_category(result)
    labels = []
    for t in table:
        label = t["method"] if t["config"] == "-" else f"{t['method']} ({t['config']})"
        if label not in labels:
            labels.append(label)
    categories = list(dict.fromkeys(t["category"] for t in table))
    env = result.get("environment", {})
    params = result.get("params", {})
    fig, axes = plt.subplots(1, 2, figsize=(max(10.0, 1.1 * len(categories) * max(len(labels), 2) + 3), 5.2),
                             constrained_layout=True)
    width = 0.8 / max(len(labels), 1)
    for ax, key, title in ((axes[0], "decode_tps", "decode tokens/s (higher is faster)"),
                           (axes[1], "speedup_vs_ar", "speed-up over plain decoding (ar = 1)")):
        for i, label in enumerate(labels):
            values = []
            for category in categories:
                match = [t for t in table if (t["method"] if t["config"] == "-" else
                                              f"{t['method']} ({t['config']})") == label and t["category"] == category]
                values.append(match[0][key] if match else 0.0)
            xs = [c + (i - (len(labels) - 1) / 2) * width for c in range(len(categories))]
            bars = ax.bar(xs, values, width, label=label)
            ax.bar_label(bars, fmt="%.2f" if key == "speedup_vs_ar" else "%.1f", fontsize=7, padding=1)
        if key == "speedup_vs_ar":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(categories)), categories, rotation=20, ha="right")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=min(len(names), 4), fontsize=8)
    fig.suptitle(f"{env.get('model', '?')} ({env.get('dtype', '?')}) on {env.get('machine', '?')}, "
                 f"{env.get('device', '')}, BLAS {env.get('blas', '?')}\n"
                 f"{len({r['prompt_id'] for r in result['rows']})} prompts, max {params.get('max_tokens', '?')} "
                 f"tokens, T={params.get('temperature', 0)}, {params.get('repeats', 1)} repeat(s)", fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
