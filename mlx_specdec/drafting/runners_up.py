"""Which of the head's runners-up a greedy step verifies beside its chain (`redrafter --runners-up`).

A greedy chain x0, d1, d2, ... is accepted up to its first wrong draft. A runner-up r at depth k
(the head's 2nd, 3rd, ... choice there, drafted behind the chain's d1..d(k-1)) is a sibling of d_k
in the tree; it is accepted exactly when d1..d(k-1) are and d_k is not, and then it is the target's
token with the head's probability for it. So it adds

    gain(r) = reach(k-1) * p(r)      reach(j) = prod_{i<=j} p(d_i)   (calibrated; reach(0) = 1)

expected tokens to the step for one more query token. Depth 1's runners-up need no reach; deeper
ones pay where the chain is sure of its first drafts and unsure of the next (a runner-up rescues
a step less often the deeper it is).

Beside a lookup's chain (`--head-beside-lookup`, greedy), the head's own first draft and its
depth-1 runners-up are offered the same way where they differ from the lookup's first draft:
siblings of it under the root, whose gain is their calibrated confidence times HEAD_BESIDE_LOOKUP
(the head is less often right where a lookup disagrees with it). A step whose rows all drafted
from lookup then makes the head's first draft as well (one depth of the head), which it
otherwise skips.

Columns are offered likeliest gain first; with a verify-cost table the step takes as many as raise
expected tokens per unit of verify cost (`verify_cost.runners_up_worth`), without one those whose
gain clears the cutoff. With `--runners-compete on` (the default) the chain's depth is not fixed
first: its drafts and the runners-up compete for the verify's query tokens (`plan_step`). Speed
only: gains come from the head's confidences, which do not depend on what the target will say, so
greedy output stays the target's.

The head's greedy chain only (`HeadProposer` stepwise), which drafts greedy steps and the default
sampling path alike: there the tree is fixed before any draw and each node takes the target's own
sample, so runners-up change speed, never the distribution (tests/test_sampling_exact_default.py
enumerates it). Not with sampled chains (`--sampled-drafts on`): a runner-up is the head's own
pick, not a draw from q, which the multi-candidate acceptance rule does not cover.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .tree import with_runners_up
from .verify_cost import CostTable, costs_at, most_tokens_per_cost, runners_up_worth

# P(the head's first draft is the target's token | the lookup drafted a different first token), over
# the head's calibrated confidence in it: counted on prompts outside every training and bench set
# (`python benchmarks/head_beside_lookup.py`).
HEAD_BESIDE_LOOKUP = 0.85


def runner_columns(tokens: np.ndarray, confidence: np.ndarray, chain: np.ndarray, judged: np.ndarray,
                   step_length: int, head_rows: np.ndarray, calibrate: Callable[[np.ndarray], np.ndarray],
                   head_first: Optional[tuple] = None):
    """tokens, confidence (B, D, S): the head's runners-up at depths 1..D; chain (B, L) the step's
    chains (root first) and judged (B, L-1) their calibrated confidences; head_rows (B,) the rows
    whose chain is the head's (a lookup's chain has no runners-up of its own); calibrate: confidence
    -> min(1, trust * confidence), (B, ...) any rank. Only depths whose chain draft the step verifies count.
    head_first: the head's first draft and its confidence (B,) each, offered beside a lookup's chain
    with the head's depth-1 runners-up (a first column, depth 1; gain 0 in the head's rows, whose
    chain it is), each at HEAD_BESIDE_LOOKUP times its calibrated confidence.
    -> tokens (B, R), gains (B, R), depths (R,): R = [1 +] D' * S columns, depth-major."""
    depth = min(tokens.shape[1], step_length - 1)
    tokens, confidence = tokens[:, :depth], confidence[:, :depth]
    B, S = len(chain), tokens.shape[2]
    # a runner-up equal to the chain's own draft (a tie at the top) adds nothing
    offered = (tokens != chain[:, 1: depth + 1, None]) & head_rows[:, None, None]
    if head_first is not None:  # and beside a lookup's chain, the head's own choices at depth 1
        first, first_confidence = head_first
        first_offered = ~head_rows & (first != chain[:, 1])
        offered[:, 0] |= first_offered[:, None] & (tokens[:, 0] != chain[:, 1:2]) & (tokens[:, 0] != first[:, None])
    probs = calibrate(np.where(offered, confidence, 0.0))
    reach = np.concatenate([np.ones((B, 1)), np.cumprod(judged[:, : depth - 1], axis=-1)], axis=1)
    gains = reach[:, :, None] * probs  # (B, D', S)
    tokens, gains, depths = tokens.reshape(B, -1), gains.reshape(B, -1), np.repeat(np.arange(1, depth + 1), S)
    if head_first is None:
        return tokens, gains, depths
    first_gain = calibrate(np.where(first_offered, first_confidence, 0.0)[:, None, None])[:, 0]  # (B, 1)
    gains = np.where(head_rows[:, None], gains, HEAD_BESIDE_LOOKUP * gains)
    return (np.concatenate([first[:, None].astype(tokens.dtype), tokens], axis=1),
            np.concatenate([HEAD_BESIDE_LOOKUP * first_gain, gains], axis=1), np.concatenate([[1], depths]))


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


def plan_step(chain_reach: np.ndarray, runner_gains: np.ndarray, runner_depths: np.ndarray, context: int,
              table: CostTable):
    """The chain's drafts and the runners-up competing for one verify's query tokens.

    chain_reach (B, K): reach(1..K) of each row's chain, as deep as the cutoff keeps it (draft j
    adds reach(j) expected tokens); runner_gains (B, R) as `runner_columns` gives them, at depths
    runner_depths (R,). Every node of the tree adds its gain for one query token, and no node gains
    more than its parent (reach falls with depth; a runner-up is at most as likely as its chain
    sibling, the head's first choice; the head's choices beside a lookup's chain are children of
    the root), so for each size n the n likeliest nodes of a row form a tree, the best one of that
    size. The step verifies the n whose rows' trees give the most expected
    tokens per unit of verify cost (B rows share one forward of 1 + n tokens):

        n* = argmax_n (B + sum_b sum of row b's n largest gains) / cost(1 + n)

    -> step_length (1 + the longest chosen chain), verify (B, R): the runners-up chosen, a row's
    trimmed to its likeliest ones where a longer chain in another row left it less room."""
    B, K = chain_reach.shape
    gains = np.concatenate([chain_reach, runner_gains], axis=1)  # (B, K + R)
    rank = np.argsort(-gains, axis=1, kind="stable")  # ties: the chain (the parent) first
    best_first = np.take_along_axis(gains, rank, axis=1)
    expected = B + np.concatenate([[0.0], np.cumsum(best_first.sum(axis=0))])  # (1 + K + R,) by n
    n = most_tokens_per_cost(expected, 1, costs_at(context, table))  # the smallest tree among equals
    chosen = np.zeros_like(gains, dtype=bool)
    np.put_along_axis(chosen, rank[:, :n], True, axis=1)
    chosen &= gains > 0
    if K:  # runners-up are packed beside a chain one draft long at least: a row that chose some of
        # them and none of its chain (the head beside a surer-looking lookup) verifies its first too
        chosen[:, 0] |= chosen[:, K:].any(axis=1)
    step_length = 1 + int(chosen[:, :K].sum(axis=1).max())
    verify = chosen[:, K:] & (runner_depths[None, :] <= step_length - 1)
    room = max(n, int(chosen.sum(axis=1).max())) + 1 - step_length  # runners-up a row may add (the forward's width)
    for b in range(B):
        picked = np.flatnonzero(verify[b])
        if len(picked) > room:
            verify[b, picked[np.argsort(-runner_gains[b, picked], kind="stable")[max(room, 0):]]] = False
    return step_length, verify


class StepRunnersUp:
    """A greedy step's runners-up, as `redrafter` uses them: offered beside the head's chains,
    chosen after the chain's depth (`choose_runners_up`) or competing with its drafts (`plan_step`),
    and added to the packed trees. proposer: the `HeadProposer` that drafted the chains;
    calibrate: confidence (B, ...) -> the row's trust in the head times it, the same shape; beside_lookup: offer
    the head's first draft beside a lookup's chain."""

    def __init__(self, proposer, calibrate: Callable[[np.ndarray], np.ndarray], cutoff: float,
                 table: Optional[CostTable], compete: bool, beside_lookup: bool = False):
        self.proposer, self.calibrate, self.cutoff, self.table = proposer, calibrate, cutoff, table
        self.compete = compete and table is not None
        self.beside_lookup = beside_lookup
        self.verified = 0  # runners-up verified, all steps (reported)

    def candidates(self, chains: np.ndarray, judged: np.ndarray, step_length: int, head_rows: np.ndarray):
        """chains (B, L), judged (B, L-1) -> `runner_columns`' tokens (B, R), gains (B, R), depths (R,)."""
        # Host sync: computed with the drafts, already evaluated when the head's drafts were read
        # (where every row drafted from lookup, the head's first draft is computed here).
        tokens, confidence = self.proposer.runners_up_on_host()
        first = self.proposer.first_on_host() if self.beside_lookup and not head_rows.all() else None
        return runner_columns(tokens, confidence, chains, judged, step_length, head_rows, self.calibrate, first)

    def plan(self, beams: np.ndarray, judged: np.ndarray, kept: int, head_rows: np.ndarray, context: int):
        """Competing: beams (B, 1, L) and judged (B, 1, L-1) the step's chains, kept the length the
        cutoff allows -> the step length and the runners-up chosen with it (for `add`)."""
        tokens, gains, depths = self.candidates(beams[:, 0], judged[:, 0], kept, head_rows)
        step_length, verify = plan_step(np.cumprod(judged[:, 0, : kept - 1], axis=-1), gains, depths, context,
                                        self.table)
        return step_length, (tokens, verify, depths)

    def add(self, beams: np.ndarray, trees: list, judged: np.ndarray, step_length: int, head_rows: np.ndarray,
            context: int, planned=None):
        """The step's chains (B, 1, L) and packings with the runners-up `plan` chose, else those worth
        verifying beside chains this long -> beams, trees, runners-up verified per row (B,), the
        depth of each runner-up beam (R,)."""
        if planned is None:
            tokens, gains, depths = self.candidates(beams[:, 0], judged[:, 0], step_length, head_rows)
            reach = np.cumprod(judged[:, 0, : step_length - 1], axis=-1)  # the chains' drafts reached
            order, verify = choose_runners_up(gains, len(trees) + float(reach.sum()),
                                              max(len(t.tokens) for t in trees), context, self.cutoff, self.table)
            tokens, depths = tokens[:, order], depths[order]
        else:
            tokens, verify, depths = planned
        self.verified += int(verify.sum())
        beams, trees = with_runners_up(beams, trees, tokens, verify, depths)
        return beams, trees, verify.sum(axis=1), depths
