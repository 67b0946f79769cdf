"""How many drafts a step should verify: the drafts' odds against what verifying them costs here.

The draft cutoff ("verify a draft only where it is at least c likely") is one number for every
context, but what one more verified token costs is not: over a long document attention's work
grows with the query rows, and a verified token costs several times what it does at chat length,
so drafts the cutoff keeps can cost more than they bring.

So after the cutoff, each step verifies the depth k (0 = a plain step) that maximises

    expected tokens / cost = sum_b (1 + sum_{j<=k} max_w prod_{i<=j} p[b,w,i]) / cost(T(k), context)

    p[b,w,i]  the calibrated probability of draft i of beam w (the source's confidence times the
              row's trust in that source)
    T(k)      query tokens the packed tree holds up to depth k (the widest row's)
    cost      a T-token forward after `context` tokens as a multiple of a one-token one

or, with `--verify-cost margin`, the depth with the most expected tokens minus rate * B * cost,
rate = the tokens per unit of cost the answer has got so far (`RateMeter`).

Greedy: speed only, whatever the rule reads (the output is the target's argmax chain).

Sampling: the rule must not read what the acceptance rule treats as random. Counting the packed
tree's tokens does: whether sampled chains share a token decided the depth, which biased the
output (q = (.45, .35, .2), p = (.1, .3, .6), two chains at 6,000 tokens: the first token came out
(.1085, .2955, .596)). What is exact: whether depth j+1 is verified depends on the drafts at
depths <= j only (a stopping rule). Given those, the drafts at depth j+1 are still fresh draws
from q behind the accepted prefix, so verifying that depth is plain (multi-candidate) rejection
sampling and cutting it leaves the target's own draw: either way each emitted token follows p
given the ones before it. (Other rows' drafts are independent of a row's: a batch shares one
depth.) So under sampling the rule
    - counts T(k) = 1 + k * breadth, fixed before any draw (breadth: W for a row of sampled
      chains, 1 for a host-side source's chain, whose W beams are one chain);
    - goes one depth deeper only while that raises its objective. reach(j+1), a max over beams of
      products of confidences (each the peak of the q its draft is drawn from, which depends on
      the drafts before it and not on the draft), is known once depth j is drawn.
With a convex cost row (each more token costing at least what the one before did, as fitted and
shipped tables are) and reach falling with depth, the ratio and the margin are unimodal in k, so
this first peak is the argmax greedy takes; with any table it is exact. The cutoff (`kept_length`)
is a stopping rule the same way.

The table is the machine's own when `mlx-specdec calibrate` has measured it there for this model
(drafting/cost_probe.py: machines differ, even of one kind). Without one, the CPU uses the
shipped table below; a GPU (Metal or CUDA), where no shipped table would fit, measures a short
one at its first use (seconds) and keeps it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

# The shipped CPU table: `mlx-specdec calibrate` on a 2-core x86 machine (the default model in
# float32, row-major weights, the small-row GEMM), fitted as `cost_probe.convex_fit` does. One row
# of T query tokens after `context` tokens, as a multiple of one token.
CPU_CONTEXTS = np.array([150.0, 2000.0, 6000.0])
CPU_COST = np.array([  # T = 1 .. 8
    [1.0, 1.02, 1.04, 1.07, 1.11, 1.15, 1.20, 1.26],  # 150 tokens
    [1.0, 1.10, 1.20, 1.31, 1.42, 1.53, 1.65, 1.77],  # 2,000
    [1.0, 1.23, 1.46, 1.69, 1.92, 2.15, 2.38, 2.61],  # 6,000
])


class CostTable(NamedTuple):
    contexts: np.ndarray  # (C,) context lengths measured, ascending
    costs: np.ndarray  # (C, T) a 1..T-token forward after each, as a multiple of a one-token one
    source: str  # where it comes from, for reports
    ratios: Optional[np.ndarray] = None  # (C, T) the measured medians the costs were fitted to, if known


def shipped_table() -> CostTable:
    return CostTable(CPU_CONTEXTS, CPU_COST, "shipped (a 2-core x86 VM, default model, float32)")


def row_by_row_table(tokens: int = 8) -> CostTable:
    """A T-token forward costing T one-token ones: MLX's quantized matmul on the CPU takes its
    rows one at a time (the default model kept 4-bit: 1.87, 3.64, 6.88 at T = 2, 4, 8), so a
    model whose weights stay packed there gains nothing from verifying several tokens at once."""
    t = np.arange(1, tokens + 1, dtype=np.float64)
    return CostTable(np.array([0.0]), t[None, :], "a quantized model kept packed on the CPU: T tokens cost T forwards")


def verify_cost(tokens: int, context: int, table: Optional[CostTable] = None) -> float:
    """A `tokens`-token forward after `context` tokens, as a multiple of a one-token forward
    (interpolated in the context; past the table's last T, extended by its last measured step)."""
    return cost_of(costs_at(context, table), tokens)


def costs_at(context: int, table: Optional[CostTable] = None) -> np.ndarray:
    """(T,) the table's row for T = 1.., interpolated at `context` (held flat outside it)."""
    table = table or shipped_table()
    contexts, costs = table.contexts, table.costs
    return np.array([np.interp(context, contexts, costs[:, t]) for t in range(costs.shape[1])])


def cost_of(per_t: np.ndarray, tokens: int) -> float:
    if tokens <= len(per_t):
        return float(per_t[tokens - 1])
    return float(per_t[-1] + (tokens - len(per_t)) * (per_t[-1] - per_t[-2]))


def kept_length(confidence: np.ndarray, cutoff: float) -> int:
    """confidence (B, W, L-1): the head's probability of each drafted token. The beam length a
    step verifies: 1 + the deepest run of leading drafts at or above the cutoff in any beam."""
    if cutoff <= 0.0:
        return confidence.shape[-1] + 1
    leading = np.cumprod(confidence >= cutoff, axis=-1).sum(axis=-1)  # (B, W) drafts kept per beam
    return int(leading.max()) + 1


def worth_verifying(probs: np.ndarray, owner: np.ndarray, kept: int, context: int,
                    rate: float | None = None, table: Optional[CostTable] = None,
                    breadth: Optional[np.ndarray] = None) -> int:
    """probs (B, W, L-1): calibrated draft probabilities; owner (B, W, L): `dedup_prefix`'s first
    beam with each prefix; kept: the step length the cutoff allows. -> the step length (1 + drafts)
    in 1..kept with the most expected tokens per unit of verify cost; with `rate` (tokens a row
    gets per unit of cost over the answer so far, `RateMeter`), the most expected tokens beyond
    what that cost buys at that rate (the "margin" rule below).

    breadth (B,): sampling (see the module docstring): the query tokens each row adds per depth,
    fixed before the draws; `owner` is then not read and the depth is the first peak."""
    if kept <= 1:
        return kept
    B, W = probs.shape[:2]
    reach = np.cumprod(probs[:, :, : kept - 1], axis=-1).max(axis=1)  # (B, kept-1): the likeliest beam to depth j
    if breadth is None:
        new_prefix = owner[:, :, :kept] == np.arange(W)[None, :, None]  # (B, W, kept): a packed token each
        tree_tokens = np.cumsum(new_prefix.sum(axis=1), axis=-1).max(axis=0)  # (kept,) T(k), widest row
    else:
        tree_tokens = 1 + np.arange(kept) * int(np.max(breadth))  # (kept,) T(k), whatever is drawn
    per_t = costs_at(context, table)  # once a step: the row for this context
    if rate is not None:
        score = [B + reach[:, :k].sum() - rate * B * cost_of(per_t, int(tree_tokens[k])) for k in range(kept)]
    else:
        score = [(B + reach[:, :k].sum()) / cost_of(per_t, int(tree_tokens[k])) for k in range(kept)]
    if breadth is None:
        return 1 + int(np.argmax(score))  # the first among equals
    k = 0  # depth k + 1 is decided from score[k + 1], which reads the drafts at depths <= k only
    while k + 1 < kept and score[k + 1] > score[k]:
        k += 1
    return 1 + k


def runners_up_worth(expected: float, tokens: int, probs: np.ndarray, context: int,
                     table: Optional[CostTable] = None) -> int:
    """How many of the head's runners-up to verify beside the step's chains.

    expected: the tokens the step's chains are expected to give (summed over rows), from a
    `tokens`-token verify; probs (S,): what each runner-up adds, likeliest first (summed over
    rows): at depth 1 its calibrated probability, since it is right exactly when its chain's first
    draft is not; deeper, that times the chain's reach (drafting/runners_up.py). k of them add
    probs[:k].sum() tokens for k more query tokens. -> the k in 0..S with the most expected tokens
    per unit of verify cost (as `worth_verifying` chooses a depth)."""
    gains = expected + np.concatenate([[0.0], np.cumsum(np.asarray(probs, dtype=np.float64))])
    return most_tokens_per_cost(gains, tokens, costs_at(context, table))


def most_tokens_per_cost(expected: np.ndarray, tokens: int, per_t: np.ndarray) -> int:
    """expected (K+1,): a step's expected tokens with k = 0..K more query tokens than `tokens`;
    per_t: the table's row at this context. -> the k with the most expected tokens per unit of
    verify cost (the smallest among equals)."""
    return int(np.argmax([e / cost_of(per_t, tokens + k) for k, e in enumerate(expected)]))


class RateMeter:
    """Tokens a row has got per unit of verify cost so far in this answer (the "margin" rule's
    rate), from a prior of PRIOR_RATE over PRIOR_COST units so the first steps have one.

    Why a rate and not the step's own ratio: the long-run speed is total tokens / total cost, and
    a step raises it by verifying one more draft exactly when that draft's expected tokens exceed
    the rate times its extra cost (Dinkelbach). The per-step ratio stops a sure step too early
    (its own ratio is above the rate) and lets a doubtful one verify at a ratio below it."""

    PRIOR_RATE, PRIOR_COST = 1.2, 5.0

    def __init__(self, table: Optional[CostTable] = None):
        self.tokens, self.cost = self.PRIOR_RATE * self.PRIOR_COST, self.PRIOR_COST
        self.table = table

    @property
    def rate(self) -> float:
        return self.tokens / self.cost

    def add(self, tokens_per_row: float, step_tokens: int, context: int) -> None:
        self.tokens += tokens_per_row
        self.cost += verify_cost(step_tokens, context, self.table)
