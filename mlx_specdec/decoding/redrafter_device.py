"""ReDrafter's step shaped for a GPU: one read, one host-built array, a few shapes.

On a GPU a small model's step is bound by what makes the device wait for the host: each blocking
read, each array built from host data, each input shape not seen before (a compile). The loop of
redrafter_step.py reads the acceptance, the head's first draft, its runners-up and each deeper
depth in syncs of their own, and uploads masks, positions and indices built on the host; that
suits a CPU, where every skipped head projection is saved arithmetic. Here a step is:

    plan, pack   on the host, from what the previous step read (the planner's rules unchanged)
    upload       ONE int32 array per step: per row its length, the packed tokens, their parents,
                 each beam token's packed index and the beams; sliced on the device
    verify       mask and positions built on the device from the parents (`masks.tree_on_device`);
                 the tree padded to a bucket of widths (VERIFY_WIDTHS), the beams to a power of two
    accept       on the device; the target's own token at every node (argmax, or a draw from
                 its top-p nucleus with no sort: `acceptance.nucleus_draws`; a node none of whose
                 draws fell in its nucleus, rare, is drawn again by the full rule after the read)
    draft        the head's whole chain and its runners-up after the accepted token, in the same graph
    read         `mx.async_eval`, then the previous step's tokens are yielded (the consumer's work
                 overlaps the device's), then the step's one blocking read
    commit       the cache keeps the accepted path (gathered on the device where it moved)

Tokens reach the caller one step late, as in `mlx_lm.generate_step`; a step the caller stops
during is rolled back (`close`). The counts are in every answer's stats (`syncs_per_step`,
`host_arrays_per_step`, `verify_shapes`) and tests/test_device_step.py holds them.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional

import mlx.core as mx
import numpy as np

from .. import masks
from ..acceptance import Accepted, greedy_accept_targets, nucleus_draws, sample_token
from ..drafting.verify_cost import CostTable, cost_of
from ..host_traffic import queue, read_host, to_device
from ..penalties import DeviceTreePenalties, TreePenalties
from .base import Step, drop_finished_rows
from .redrafter_step import RedrafterLoop
from .redrafter_types import Plan, Read, Settings, Tree

VERIFY_WIDTHS = (1, 4, 8, 16, 32, 64)  # a verify's query tokens are padded to one of these


def verify_width(tokens: int) -> int:
    for width in VERIFY_WIDTHS:
        if tokens <= width:
            return width
    return -(-tokens // VERIFY_WIDTHS[-1]) * VERIFY_WIDTHS[-1]


def beam_width(beams: int) -> int:
    return 1 << max(0, beams - 1).bit_length()


@mx.compile
def _accept(beams: mx.array, own: mx.array, index: mx.array, hidden: mx.array):
    """beams (B, W, L) padded; own (B, n) the target's token at each packed node; index (B, W*L)
    each beam token's node; hidden (B, n, D). -> the beam accepted from, its drafts accepted, the
    next token (B,) each, and the hidden state after the last accepted token (B, D). One compiled
    graph per bucket of shapes."""
    B, W, L = beams.shape
    targets = mx.take_along_axis(own, index, axis=1)  # (B, W*L)
    result = greedy_accept_targets(beams, targets.reshape(B, W, L))
    flat = result.beam * L + result.num_accepted  # (B,) the last accepted token, beam-major
    last = mx.take_along_axis(index, flat[:, None], axis=1)  # (B, 1) its packed position
    return (*result, mx.take_along_axis(hidden, last[..., None], axis=1)[:, 0])


def bucketed(table: Optional[CostTable], step_overhead: float = 0.0) -> Optional[CostTable]:
    """The verify-cost table as the device step pays it: T query tokens cost what the verify
    width they are padded to does (so the planner fills a bucket it pays for anyway), plus the
    step's fixed cost (drafting/step_cost.py), which every step pays whatever its width."""
    if table is None:
        return None
    widths = range(1, 4 * VERIFY_WIDTHS[-1] + 1)  # past the table, `cost_of` extends its last step
    costs = np.array([[cost_of(row, verify_width(t)) + step_overhead for t in widths] for row in table.costs])
    fixed = f" + {step_overhead:.2f} a step" if step_overhead else ""
    return table._replace(costs=costs, source=f"{table.source}, by verify width{fixed}")


class DeviceLoop(RedrafterLoop):
    """`RedrafterLoop` with the step of this module's docstring (redrafter.py chooses it)."""

    def __init__(self, ctx, s: Settings, sources, vocab: int):
        table = bucketed(s.cost_table, ctx.resources.get("step_overhead") or 0.0)
        super().__init__(ctx, dataclasses.replace(s, cost_table=table), sources, vocab)
        self.head.whole_chain = bool(getattr(self.head, "stepwise", False))
        self.pending: List[Step] = []  # the last step's tokens, yielded while the next one computes
        self.valid_dev = None  # (B, P) `valid` on the device, only while some row has holes
        self.drawn = None  # the last verify's (penalized logits, own tokens, held) for `settle`

    def start(self) -> Iterator[Step]:
        yield from super().start()
        if isinstance(self.penalties, TreePenalties):  # from here the penalties' state stays on the device
            self.penalties = DeviceTreePenalties(self.penalties)
        if not self.valid.all():  # a batch of prompts of different lengths: padding is a hole
            self.valid_dev = to_device(self.valid)

    # -- drafts read with the step ---------------------------------------------------------------

    def first_drafts(self, token: mx.array, hidden: mx.array, own: np.ndarray) -> None:
        drafts = self.head.propose(token, hidden)
        self.adopt(drafts, own, read_host(*self.draft_outputs(drafts)))

    def draft_outputs(self, drafts) -> list:
        """What the step reads of the next drafts: the beams and confidences, the head's runners-up
        and first draft."""
        extra = self.head.lazy_outputs() if self.head.whole_chain else []
        return [drafts.beams, drafts.owner, drafts.confidence, *extra]

    def adopt(self, drafts, own: np.ndarray, values: list) -> None:
        """The next step's drafts from the read `values` (`draft_outputs`) and the own tokens."""
        beams, owner, confidence, *extra = values
        if self.head.whole_chain:
            self.head.took(extra)
        if self.first_offer is None:
            self.beams, self.owner, self.confidence = beams.astype(np.int32), owner, confidence
            self.source = np.full(len(own), self.fallback)
        else:
            done = self.first_offer.draft(drafts, own, fallback_read=(beams, confidence), upload=False)
            _, self.beams, self.owner, self.confidence, self.source, _ = done
        self.drafts = drafts

    def deepen(self) -> None:
        """Every depth was drafted in the step's graph."""

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> Iterator[Step]:
        plan, tree, out = self.planned_verify()
        length = tree.device_beams.shape[-1]
        result, hidden = self.accept(tree, length, out)
        self.mark("accept_s", result, hidden)
        drafts = self.head.propose(result.next_token, hidden)
        held = self.drawn[2]
        wanted = [result.beam, result.num_accepted, result.next_token, *self.draft_outputs(drafts)]
        queue(*wanted, *([] if held is None else [held]))
        yield from self.flush()  # the consumer's work on the last step's tokens overlaps this one
        best, accepted, token, *values = read_host(*wanted, *([] if held is None else [held]))  # the one read
        if held is not None and self.unsettled(tree, values.pop()):
            result, hidden = self.settle(tree, out)
            drafts = self.head.propose(result.next_token, hidden)
            wanted = [result.beam, result.num_accepted, result.next_token, *self.draft_outputs(drafts)]
            best, accepted, token, *values = read_host(*wanted)  # deliberate: a rare second read
        self.mark("sync_s")
        self.penalties.commit_accepted(tree.device_beams, result.beam, result.num_accepted, result.next_token)
        self._best_dev, self._accepted_dev = result.beam, result.num_accepted
        if self.first_offer is not None:
            kept = [tree.beams[b, best[b], : accepted[b] + 1] for b in range(len(self.rows))]
            self.first_offer.commit(kept, verified=plan.step_length - 1)
        read = Read(best, accepted, token, None, None, None, None, None)
        new_tokens = self.commit(tree, plan.step_length, read)  # the trust learns from this step's drafts
        self.adopt(drafts, token, values)
        self.pending = [Step(new_tokens[b], thread_id=thread, drafted=plan.step_length - 1 + int(tree.extra[b]),
                             accepted=int(accepted[b])) for b, thread in enumerate(self.rows)]
        self.rows, self.keep = drop_finished_rows(self.rows, new_tokens, self.emitted, self.ctx.lm.eos_token_ids,
                                                  self.params.max_tokens, self.ctx.stopped_rows)
        if not self.rows:
            yield from self.flush()

    def flush(self) -> Iterator[Step]:
        pending, self.pending = self.pending, []
        for step in pending:
            if step.thread_id not in self.ctx.stopped_rows:
                yield step

    def pack(self, plan: Plan) -> Tree:
        """The host's trees as one upload: per row [length | tokens | parents | index | beams],
        the tokens padded to a verify width, the beams to a power of two and the full length."""
        beams, trees, extra, runner_depth, drafts = self.packed_trees(plan)
        B, W, L = beams.shape
        n = verify_width(max(len(t.tokens) for t in trees))
        Wb, Lb = beam_width(W), max(L, self.s.length)
        packed = np.zeros((B, 1 + 2 * n + 2 * Wb * Lb), dtype=np.int32)
        packed[:, 0] = self.lengths
        packed[:, 1 + n: 1 + 2 * n] = -1  # parents: padding is a root
        index = np.zeros((B, Wb, Lb), dtype=np.int32)  # padding points at the root ...
        padded = np.full((B, Wb, Lb), -1, dtype=np.int32)  # ... and its drafts match no token
        padded[:, :, 0] = beams[:, :1, 0]
        for b, t in enumerate(trees):
            packed[b, 1: 1 + len(t.tokens)] = t.tokens
            packed[b, 1 + n: 1 + n + len(t.tokens)] = t.parents
            index[b, :W, :L] = t.index
            padded[b, :W, :L] = beams[b]
        packed[:, 1 + 2 * n: 1 + 2 * n + Wb * Lb] = index.reshape(B, -1)
        packed[:, 1 + 2 * n + Wb * Lb:] = padded.reshape(B, -1)
        self.traffic.verify((B, n))
        device = to_device(packed)  # the step's one host-built array
        lengths, tokens, parents = device[:, 0], device[:, 1: 1 + n], device[:, 1 + n: 1 + 2 * n]
        index_dev = device[:, 1 + 2 * n: 1 + 2 * n + Wb * Lb]  # (B, Wb*Lb)
        beams_dev = device[:, 1 + 2 * n + Wb * Lb:].reshape(B, Wb, Lb)
        tree_mask, depths = masks.tree_on_device(parents)  # (B, 1, n, n), (B, n)
        positions = lengths[:, None] + depths  # (B, n)
        return Tree(beams, trees, tokens, positions, tree_mask, index_dev, drafts, extra, runner_depth, beams_dev,
                    depths)

    def verify(self, tree: Tree):
        from ..model.forward import forward

        mask = tree.mask
        if self.valid_dev is not None:  # holes: each query sees its row's valid slots, then its tree
            B, _, n, _ = mask.shape
            history = mx.broadcast_to(self.valid_dev[:, None, None, :], (B, 1, n, self.valid_dev.shape[1]))
            mask = mx.concatenate([history, mask], axis=-1)
        return forward(self.model, tree.tokens, self.cache, positions=tree.positions, mask=mask)

    def accept(self, tree: Tree, length: int, out):
        logits = self.penalties.on_tree(out.logits, tree.tokens, tree.mask, tree.depths,
                                        tree.device_beams.shape[-1])  # (B, n, V)
        own, held = self.node_draws(logits)
        self.drawn = (logits, own, held)  # kept for `settle`
        beam, accepted, token, hidden = _accept(tree.device_beams, own, tree.index, out.hidden)
        return Accepted(beam, accepted, token), hidden

    def node_draws(self, logits: mx.array):
        """The target's own token at every node, with no read and no sort -> (tokens (B, n), held
        (B, n): whether each node's draw is final, None where every draw is). Greedy: the argmax;
        top-p: `nucleus_draws`; plain sampling: as `ar` draws."""
        p = self.params
        if p.greedy or not 0.0 < p.top_p < 1.0:
            return super().own_token(logits), None
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return nucleus_draws(logprobs, p.temperature, p.top_p)

    @staticmethod
    def unsettled(tree: Tree, held: np.ndarray) -> bool:
        """Whether a real node (not padding) of the step holds no draw in its nucleus."""
        return not all(held[b, : len(t.tokens)].all() for b, t in enumerate(tree.packed))

    def settle(self, tree: Tree, out):
        """The step again with its unheld nodes drawn by the full rule (a sort): exact, since which
        nodes are drawn again depends only on the draws they discard."""
        logits, own, held = self.drawn
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        fresh = sample_token(logprobs, self.params.temperature, self.params.top_p).astype(own.dtype)
        own = mx.where(held, own, fresh)
        beam, accepted, token, hidden = _accept(tree.device_beams, own, tree.index, out.hidden)
        return Accepted(beam, accepted, token), hidden

    def keep_accepted(self, tree: Tree, best: np.ndarray, accepted: np.ndarray) -> None:
        """As `RedrafterLoop.keep_accepted`, the moved paths gathered on the device."""
        width = int(accepted.max()) + 1
        physical = self.committed
        L = tree.device_beams.shape[-1]
        in_place = all(np.array_equal(tree.packed[b].index[best[b], : accepted[b] + 1], np.arange(accepted[b] + 1))
                       for b in range(len(self.rows)))
        if in_place:
            self.cache._keep_first(physical, width)
        else:
            steps = mx.minimum(mx.arange(width)[None, :], self._accepted_dev[:, None])  # holes repeat a kept one
            start = (self._best_dev * L).astype(mx.int32)[:, None]  # (B, 1) the accepted beam's first
            kept = mx.take_along_axis(tree.index, start + steps, axis=1)
            for layer in self.cache.layers:
                layer.keep_appended_rows(physical, kept.astype(mx.int32), width)
        self.committed = self.cache.offset
        new_valid = np.zeros((len(self.rows), width), dtype=bool)
        for b in range(len(self.rows)):
            new_valid[b, : accepted[b] + 1] = True
        self.valid = np.concatenate([self.valid, new_valid], axis=1)
        if self.valid_dev is not None or not new_valid.all():
            fresh = mx.arange(width)[None, :] <= self._accepted_dev[:, None]  # (B, width), on the device
            if self.valid_dev is None:  # the first holes: the history so far, once
                self.valid_dev = to_device(self.valid[:, :-width])
            self.valid_dev = mx.concatenate([self.valid_dev, fresh], axis=1)

    def select_rows(self) -> None:
        keep = self.keep
        super().select_rows()
        if keep is not None and self.valid_dev is not None:
            self.valid_dev = None if self.valid.all() else to_device(self.valid)
