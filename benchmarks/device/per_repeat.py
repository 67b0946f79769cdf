"""Per-repeat totals of a bench markdown report: tok/s, x over `ar` in the same repeat, tokens per
forward, identical prompts. On a GPU the first repeat of a process pays kernel compiles that the
summary row averages in; this shows each repeat apart.

    python benchmarks/device/per_repeat.py REPORT.md [REPORT.md ...]
"""

import sys
from collections import defaultdict


def per_repeat(path: str) -> dict:
    """(method, config, repeat) -> [new tokens, decode seconds, forwards, identical prompts]."""
    totals = defaultdict(lambda: [0, 0.0, 0, 0])
    header = None
    for line in open(path):
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if cells[:3] == ["method", "config", "prompt_id"]:
            header = cells  # the per-prompt table starts here
        elif header and len(cells) == len(header) and cells[0] != "method":
            row = dict(zip(header, cells))
            t = totals[(row["method"], row["config"], int(row["repeat"]))]
            t[0] += int(row["new_tokens"])
            t[1] += float(row["decode_s"])
            t[2] += int(row["forward_passes"])
            t[3] += row["identical_to_ar"] == "True"
    return totals


def main() -> None:
    for path in sys.argv[1:]:
        totals = per_repeat(path)
        print(path)
        for (method, config, repeat), (tokens, seconds, forwards, same) in sorted(totals.items()):
            ar_tokens, ar_seconds = totals[("ar", "-", repeat)][:2]
            speedup = (tokens / seconds) / (ar_tokens / ar_seconds)
            print(f"  {method:9s} {config:45s} repeat {repeat + 1}: {tokens / seconds:7.1f} tok/s  "
                  f"x{speedup:.3f}  {tokens / forwards:.3f} tok/forward  identical {same}")


if __name__ == "__main__":
    main()
