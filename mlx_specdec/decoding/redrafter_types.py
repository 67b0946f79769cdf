"""The values ReDrafter's loop passes between its parts (redrafter_step.py): its settings, a
step's plan, the tree it verifies, and what the step's host sync read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import mlx.core as mx
import numpy as np

from ..drafting import Proposal
from ..drafting.tree import PackedTree
from ..drafting.verify_cost import CostTable

PHASES = ("draft_s", "pack_s", "verify_s", "accept_s", "sync_s")


@dataclass
class Settings:
    width: int  # beams the head drafts per step
    length: int  # tokens per beam, the target's own first
    cutoff: float  # verify a draft only where its calibrated confidence clears this
    use_trust: bool  # calibrate each source's confidence by its running trust per row
    cost_table: Optional[CostTable]  # this machine's verify costs (None: no cost rule)
    cost_aware: bool  # the step length follows the verify cost at this context
    margin: bool  # ... by the answer's rate so far (`RateMeter`), not the step's own ratio
    eager: bool  # every depth of the head's drafts in one graph, read with the acceptance
    stepwise: bool  # greedy chains drafted one depth at a time, as deep as a step can verify
    runners_up: int  # the head's next choices offered beside its chain's drafts
    runner_depths: int  # ... at this many of its first drafts
    deepen_reach: float  # draft deeper only while some chain is at least this likely whole
    compete: bool  # chain drafts and runners-up compete for the verify's tokens
    beside_host: bool  # the head's first draft offered beside a host-side source's chain
    prompt_draft: bool  # the first forward verifies drafts made from the prompt
    sampled_drafts: bool  # sampling: the head samples its chains and rejection sampling accepts them
    profile: bool  # a deliberate sync per phase, to time it


class Plan(NamedTuple):
    step_length: int  # 1 + the drafts each beam verifies (1: a plain step)
    judged: np.ndarray  # (B, W, L-1) calibrated confidences, before the cut
    runners: Optional[tuple]  # the runners-up `plan_step` chose with the chain's depth
    with_runners: bool  # the head's runners-up may join the tree


class Tree(NamedTuple):
    beams: np.ndarray  # (B, W', L') the beams verified (W' > W: runners-up beside the chains)
    packed: List[PackedTree]  # per row
    tokens: mx.array  # (B, N) the packed tree, padded to the widest row
    positions: Optional[mx.array]  # (B, N); None: a contiguous chain (`ar`'s call)
    mask: Optional[mx.array]
    index: mx.array  # (B, W'*L') each beam token's packed position
    drafts: Proposal  # the step's drafts (their q cut to the step length, when sampling)
    extra: np.ndarray  # (B,) runners-up verified per row
    runner_depth: np.ndarray  # (R,) the depth of each runner-up beam
    device_beams: Optional[mx.array] = None  # (B, Wb, Lb) the beams padded to a bucket (the device step)
    depths: Optional[mx.array] = None  # (B, N) each packed token's depth, on the device (the device step)


class Read(NamedTuple):  # the step's host sync: its acceptance, and the next step's drafts
    best: np.ndarray  # (B,) the beam accepted from
    accepted: np.ndarray  # (B,) its drafts accepted
    token: np.ndarray  # (B,) the target's own next token
    drafts: Proposal  # the next step's
    beams: np.ndarray
    owner: np.ndarray
    confidence: np.ndarray
    source: np.ndarray  # (B,) the index of the source that drafted each row
