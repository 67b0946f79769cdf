"""Which of the head's runners-up a greedy step verifies beside its chain (`redrafter --runners-up`).

A greedy chain x0, d1, d2, ... is accepted up to its first wrong draft. A runner-up r at depth k
(the head's 2nd, 3rd, ... choice there, drafted behind the chain's d1..d(k-1)) is a sibling of d_k
in the tree; it is accepted exactly when d1..d(k-1) are and d_k is not, and then it is the target's
token with the head's probability for it. So it adds

    gain(r) = reach(k-1) * p(r)      reach(j) = prod_{i<=j} p(d_i)   (calibrated; reach(0) = 1)

expected tokens to the step for one more query token. Depth 1's runners-up need no reach; deeper
ones pay where the chain is sure of its first drafts and unsure of the next (teacher forced on the
bench answers with head v9: a runner-up rescues a step at depth 1 12.4 % of the time, at depth 2
5.9 %, at depth 3 3.0 %: benchmarks/results/issue18_stop42.md).

Columns are offered likeliest gain first; with a verify-cost table the step takes as many as raise
expected tokens per unit of verify cost (`verify_cost.runners_up_worth`), without one those whose
gain clears the cutoff. Speed only: gains come from the head's confidences, which do not depend on
what the target will say, so greedy output stays the target's.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .verify_cost import CostTable, runners_up_worth


def runner_columns(tokens: np.ndarray, confidence: np.ndarray, chain: np.ndarray, judged: np.ndarray,
                   step_length: int, head_rows: np.ndarray, calibrate: Callable[[np.ndarray], np.ndarray]):
    """tokens, confidence (B, D, S): the head's runners-up at depths 1..D; chain (B, L) the step's
    chains (root first) and judged (B, L-1) their calibrated confidences; head_rows (B,) the rows
    whose chain is the head's (a lookup's chain has no runners-up); calibrate: confidence ->
    min(1, trust * confidence), any shape. Only depths whose chain draft the step verifies count.
    -> tokens (B, R), gains (B, R), depths (R,): R = D' * S columns, depth-major."""
    depth = min(tokens.shape[1], step_length - 1)
    tokens, confidence = tokens[:, :depth], confidence[:, :depth]
    # a runner-up equal to the chain's own draft (a tie at the top) adds nothing
    fresh = (tokens != chain[:, 1: depth + 1, None]) & head_rows[:, None, None]
    probs = calibrate(np.where(fresh, confidence, 0.0))
    reach = np.concatenate([np.ones((len(chain), 1)), np.cumprod(judged[:, : depth - 1], axis=-1)], axis=1)
    gains = reach[:, :, None] * probs  # (B, D', S)
    S = tokens.shape[2]
    return (tokens.reshape(len(chain), -1), gains.reshape(len(chain), -1),
            np.repeat(np.arange(1, depth + 1), S))


def choose_runners_up(gains: np.ndarray, expected: float, tree_tokens: int, context: int, cutoff: float,
                      table: Optional[CostTable]):
    """gains (B, R). expected: the tokens the step's chains are expected to give (all rows) from a
    `tree_tokens`-token verify. -> order (R,) the columns likeliest gain first, verify (B, R) in
    that order: which to verify (cost-aware with a table, else gain >= cutoff)."""
    order = np.argsort(-gains.sum(axis=0), kind="stable")
    gains = gains[:, order]
    if table is None:
        return order, gains >= cutoff
    count = runners_up_worth(expected, tree_tokens, gains.sum(axis=0), context, table)
    return order, (np.arange(gains.shape[1]) < count)[None] & (gains > 0)
