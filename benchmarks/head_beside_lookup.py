"""Where a row drafts from prompt lookup, how often is the head's own first draft the target's token?

    python benchmarks/head_beside_lookup.py bench --methods redrafter --head-beside-lookup off \
        --prompts PROMPTS.jsonl --max-tokens 96

Runs the given `mlx-specdec` command with `FirstOffer.draft`/`commit` wrapped: at every lookup step
it also reads the head's first draft (and confidence) and, after the step, the target's token
there. Prints, by the head's confidence, how often the two first drafts differ and which one was
right; `HEAD_BESIDE_LOOKUP` in drafting/runners_up.py is the head's hits over its summed confidence
where they differ (run on prompts outside every bench set: results/issue18_stop44.md).
"""

from __future__ import annotations

import collections
import sys

import numpy as np

import mlx_specdec  # noqa: F401  (first: picks the system BLAS before mlx.core loads)
from mlx_specdec.drafting import first_offer as L
from mlx_specdec.drafting.base import read_host

counts = collections.Counter()
seen = []  # (head confidence, lookup right, head right, same first draft) per lookup step
draft, commit = L.FirstOffer.draft, L.FirstOffer.commit


def counted_commit(self, tokens, verified=None):
    self._step_tokens = [[int(t) for t in row] for row in tokens]
    return commit(self, tokens, verified)


def counted_draft(self, head, own):
    pending, tokens = getattr(self, "_pending", None), getattr(self, "_step_tokens", None)
    if pending is not None and tokens is not None and len(pending) == len(own):
        for b, (lookup_first, head_first, confidence) in enumerate(pending):
            if lookup_first is None:
                continue
            target = tokens[b][1] if len(tokens[b]) > 1 else int(own[b])  # the step's first drafted position
            counts["lookup steps"] += 1
            counts["lookup right"] += lookup_first == target
            counts["head right"] += head_first == target
            counts["head right where the lookup is wrong"] += lookup_first != target and head_first == target
            seen.append((confidence, lookup_first == target, head_first == target, head_first == lookup_first))
    out = draft(self, head, own)
    head_beams, head_confidence = read_host(head.beams, head.confidence)  # a sync the decoder may skip
    self._pending = [(int(out.beams[b, 0, 1]), int(head_beams[b, 0, 1]), float(head_confidence[b, 0, 0]))
                     if out.from_host[b] else (None, None, None) for b in range(len(own))]
    self._step_tokens = None
    return out


def main() -> None:
    L.FirstOffer.draft, L.FirstOffer.commit = counted_draft, counted_commit
    from mlx_specdec.cli import main as cli

    cli(sys.argv[1:])
    print(dict(counts), file=sys.stderr)
    if not seen:
        return
    a = np.array(seen, dtype=np.float64)
    differ = a[:, 3] == 0
    print("| head confidence | lookup steps | first drafts differ | head right there | lookup right there |", file=sys.stderr)
    print("|---|---:|---:|---:|---:|", file=sys.stderr)
    for lo, hi in [(0, .2), (.2, .4), (.4, .6), (.6, .8), (.8, 1.01)]:
        band = (a[:, 0] >= lo) & (a[:, 0] < hi)
        print(f"| {lo:.1f}-{min(hi, 1):.1f} | {band.sum()} | {(band & differ).sum()} | {a[band & differ, 2].sum():.0f} "
              f"| {a[band & differ, 1].sum():.0f} |", file=sys.stderr)
    print(f"where they differ: head right {a[differ, 2].sum():.0f}, its confidences sum to {a[differ, 0].sum():.1f} "
          f"(ratio {a[differ, 2].sum() / max(a[differ, 0].sum(), 1e-9):.2f})", file=sys.stderr)


if __name__ == "__main__":
    main()
