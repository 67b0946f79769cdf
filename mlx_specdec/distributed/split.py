"""Which layers each rank holds: contiguous ranges, an even split by default.

Rank 0 (the head) also holds the token embedding; the last rank the final norm and the vocabulary
projection (with tied embeddings that is the embedding matrix again). The head's extra work
(sampling, verification, drafting) is why an uneven split puts the leftover layers on the last
ranks, not on rank 0 (llama.cpp's MPI split gives them to node 0; the head there does no layer
work beyond its slice either way, so either choice is defensible: measure with `--split`).
"""

from __future__ import annotations

from typing import List, Optional

from ..errors import UserError


def plan_split(num_layers: int, ranks: int, split: Optional[str] = None) -> List[range]:
    """Layer ranges per rank. `split`: comma-separated layer counts, one per rank ("10,20"),
    adding up to the model's layers; None splits evenly."""
    if ranks < 2:
        raise UserError(f"a pipeline needs at least 2 ranks, not {ranks}")
    if ranks > num_layers:
        raise UserError(f"{ranks} ranks for a model of {num_layers} layers: every rank needs at least one layer")
    if split is None:
        base, extra = divmod(num_layers, ranks)
        counts = [base + (1 if rank >= ranks - extra else 0) for rank in range(ranks)]
    else:
        try:
            counts = [int(part) for part in split.split(",")]
        except ValueError:
            raise UserError(f"--split is comma-separated layer counts, one per rank (e.g. 15,15), not {split!r}")
        if len(counts) != ranks:
            raise UserError(f"--split gives {len(counts)} layer counts for {ranks} ranks")
        if any(c < 1 for c in counts):
            raise UserError(f"--split {split}: every rank needs at least one layer")
        if sum(counts) != num_layers:
            raise UserError(f"--split {split} adds up to {sum(counts)} layers; the model has {num_layers}")
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges
