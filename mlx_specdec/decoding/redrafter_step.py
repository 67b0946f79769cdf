"""ReDrafter's decoding loop in named parts: plan, pack, verify, accept, draft, commit.

`RedrafterLoop` holds a batch's state between steps (the cache and which of its slots each row
holds, the step's drafts, the running trust in each source) and `step` runs the parts in order;
redrafter.py describes what each does and reads the method's settings.
"""

from __future__ import annotations

import time
from typing import Dict, Iterator, List

import mlx.core as mx
import numpy as np

from .. import masks, penalties
from ..acceptance import Accepted, greedy_accept_targets, sample_top_nucleus, sampling_accept, target_probs
from ..drafting import Proposal, Proposer, select_rows
from ..drafting.base import read_host as _read
from ..drafting.calibration import DraftTrust
from ..drafting.first_offer import FirstOffer
from ..drafting.runners_up import StepRunnersUp
from ..drafting.tree import pack_beams
from ..drafting.verify_cost import RateMeter, kept_length, worth_verifying
from ..host_traffic import Tally, to_device
from ..model.forward import forward
from .base import (DecodeContext, Step, drop_finished_rows, keep_prefix, new_contiguous_cache, prefill_rows,
                   prefilled_cache)
from .redrafter_types import PHASES, Plan, Read, Settings, Tree


class RedrafterLoop:
    def __init__(self, ctx: DecodeContext, s: Settings, sources: Dict[str, Proposer], vocab: int):
        """sources: by name, in the order asked: host-side ones (`FirstOffer`), then the head,
        which drafts every row they leave."""
        self.ctx, self.s, self.names = ctx, s, list(sources)
        *host_sources, self.head = sources.values()
        self.model, self.params, self.stats = ctx.lm.model, ctx.params, ctx.stats
        self.first_offer = FirstOffer(host_sources, vocab) if host_sources else None
        rows = ctx.prompts or ([ctx.prompt] if ctx.prompt else [])  # none: a continuous batch, rows join later
        self.penalties = penalties.for_rows(ctx.params, rows, vocab)  # each node by its path
        self.fallback = len(host_sources)  # the head's index in `source`
        self.source_steps = np.zeros(len(sources), dtype=np.int64)  # row-steps each source drafted
        self.meter = RateMeter(s.cost_table) if s.margin else None
        self.timings, self._t0 = dict.fromkeys(PHASES, 0.0), 0.0  # --profile: seconds per phase
        self.resumed = None  # one row resumed from the prefix store: its prompt but the last token
        self.per_position = np.zeros(s.length - 1, dtype=np.int64)  # row-steps that accepted >= k+1 drafts
        self.traffic = Tally()  # this answer's host reads, host-built arrays and verify shapes
        self.tally = dict.fromkeys(("steps", "before", "after", "lookup_steps", "lookup_accepted", "runners_up",
                                    "runners_up_accepted", "runners_up_deeper_accepted"), 0)

    def start(self) -> Iterator[Step]:
        """Prefill, the target's first tokens (yielded before any drafting: like every method's,
        ReDrafter's TTFT is prefill + the first token's forward), then the first drafts."""
        ctx, s = self.ctx, self.s
        prompts = ctx.prompts or [ctx.prompt]
        self.rows, self.keep = list(range(len(prompts))), None  # live rows' thread ids
        self.cache = new_contiguous_cache(ctx)
        # Drafting from the prompt: the last prompt token is the step's own token and the hidden
        # state before it drafts, so the first forward verifies drafts too.
        from_prompt = s.prompt_draft and min(len(p) for p in prompts) >= 2
        texts = [p[:-1] for p in prompts]
        if from_prompt:
            self.valid, hidden = prefill_rows(ctx, self.cache, texts, last_hidden=True)  # (B, P), (B, D)
        elif len(texts) == 1 and ctx.resources.get("prefix_store") is not None:  # resumed from a recent prompt
            self.cache, self.resumed = prefilled_cache(ctx, texts[0]), texts[0]
            self.valid, hidden = np.ones((1, len(texts[0])), dtype=bool), None
        else:
            self.valid, hidden = prefill_rows(ctx, self.cache, texts), None
        self.lengths = np.array([len(p) - 1 for p in prompts])  # committed tokens per row
        self.emitted = np.zeros(len(self.rows), dtype=np.int64)
        own = np.array([p[-1] for p in prompts])  # the target's own latest token per row, on the host
        token = mx.array(own)
        if not from_prompt:
            plain = [[-1]] * len(self.rows)
            out = forward(self.model, token[:, None], self.cache,
                          positions=masks.ragged_tree_positions(self.lengths, plain, 1),
                          mask=masks.ragged_tree_mask(self.valid, plain, 1))
            self.valid = np.concatenate([self.valid, np.ones((len(self.rows), 1), dtype=bool)], axis=1)
            self.lengths += 1
            token, hidden = self.own_token(self.penalties.first(out.logits[:, -1])), out.hidden[:, -1]
            own = _read(token)[0]  # host sync: the first tokens alone, yielded before any drafting
            self.penalties.commit([[int(t)] for t in own])
            self.stats.forward_passes += 1
            for b in self.rows:
                yield Step([int(own[b])], thread_id=b)
            self.emitted += 1
            self.rows, self.keep = drop_finished_rows(self.rows, [[int(t)] for t in own], self.emitted,
                                                      ctx.lm.eos_token_ids, self.params.max_tokens, ctx.stopped_rows)
        self.committed = self.cache.offset
        self.learners(len(prompts))
        self.head.begin(texts if from_prompt else prompts)  # the text before `own` (a draft model keeps it)
        if self.first_offer is not None:
            self.first_offer.begin(texts if from_prompt else prompts)
        if self.rows:  # the first drafts, from the hidden state that produced the own tokens
            self.first_drafts(token, hidden, own)
        self.traffic = Tally()  # the steps' own counts, from here

    def first_drafts(self, token: mx.array, hidden: mx.array, own: np.ndarray) -> None:
        """The first step's drafts after the own tokens (B,), which `own` holds on the host."""
        self.drafts = self.head.propose(token, hidden)
        if self.first_offer is None:  # host sync: the first drafts
            self.beams, self.owner, self.confidence = _read(self.drafts.beams, self.drafts.owner,
                                                            self.drafts.confidence)
        else:
            self.drafts, self.beams, self.owner, self.confidence, self.source, _ = self.first_offer.draft(
                self.drafts, own)
        self.deepen()

    def learners(self, rows: int) -> None:
        """Each source's trust per row (the head's last), the runners-up's planner, each row's source."""
        s = self.s
        self.trusts = [DraftTrust(rows) for _ in range(self.fallback + 1)]
        self.runners = StepRunnersUp(self.head, self.trusts[-1].calibrated if s.use_trust else (lambda c: c),
                                     s.cutoff, s.cost_table if s.cost_aware else None, s.compete, s.beside_host)
        self.source = np.full(rows, self.fallback)  # per prompt, as `keep` indexes them

    def step(self) -> Iterator[Step]:
        plan, tree, out = self.planned_verify()
        result, hidden = self.accept(tree, plan.step_length, out)
        self.mark("accept_s", result, hidden)
        read = self.draft(tree, plan.step_length, result, hidden)
        new_tokens = self.commit(tree, plan.step_length, read)
        self._t0 = time.perf_counter()
        self.deepen()
        self.mark("draft_s")
        for b, thread in enumerate(self.rows):
            yield Step(new_tokens[b], thread_id=thread, drafted=plan.step_length - 1 + int(tree.extra[b]),
                       accepted=int(read.accepted[b]))
        self.rows, self.keep = drop_finished_rows(self.rows, new_tokens, self.emitted, self.ctx.lm.eos_token_ids,
                                                  self.params.max_tokens, self.ctx.stopped_rows)

    def planned_verify(self):
        """The step's first parts: rows that finished leave, plan, pack, verify -> (plan, tree, out)."""
        self.select_rows()
        self._t0 = time.perf_counter()
        plan = self.plan()
        tree = self.pack(plan)
        self.mark("pack_s")
        out = self.verify(tree)
        self.mark("verify_s", out.logits)
        return plan, tree, out

    def verify(self, tree: Tree):
        return forward(self.model, tree.tokens, self.cache, positions=tree.positions, mask=tree.mask)

    def select_rows(self) -> None:
        """Rows that finished leave the batch: their cache rows, their state and their drafts."""
        keep = self.keep
        if keep is None:
            return
        self.cache.select_rows(keep)
        self.valid, self.lengths, self.beams, self.owner, self.confidence, self.emitted, self.source = (
            a[keep] for a in (self.valid, self.lengths, self.beams, self.owner, self.confidence, self.emitted,
                              self.source))
        self.drafts = select_rows(self.drafts, keep)
        self.head.select_rows(keep)
        for part in (*self.trusts, self.penalties):
            part.select_rows(keep)
        if self.first_offer is not None:
            self.first_offer.select_rows(keep)

    def plan(self) -> Plan:
        """How deep this step verifies: up to the deepest draft (over beams and rows) that every
        draft before it in its beam clears the cutoff, each source's confidence calibrated by
        the row's trust in it; a step with none is a plain step. Of that, the depth worth this
        context's verify cost, or the chain's drafts and the head's runners-up competing for it."""
        s, head_rows = self.s, self.source == self.fallback
        judged = self.calibrated(self.confidence)
        step_length = kept_length(judged, s.cutoff)
        planned = None
        with_runners = bool(self.head.runners_up) and step_length > 1 and (s.beside_host or head_rows.any())
        if with_runners and self.runners.compete:
            step_length, planned = self.runners.plan(self.beams, judged, step_length, head_rows,
                                                     int(self.lengths.max()))
        elif s.cost_aware:  # sampling: from what is fixed before the draws (verify_cost.py, "Sampling")
            breadth = np.where(head_rows, self.beams.shape[1], 1) if s.sampled_drafts else None
            rate = self.meter.rate if self.meter is not None else None
            step_length = worth_verifying(judged, self.owner, step_length, int(self.lengths.max()), rate=rate,
                                          table=s.cost_table, breadth=breadth)
        return Plan(step_length, judged, planned, with_runners)

    def pack(self, plan: Plan) -> Tree:
        """The drafts cut to the step length, each row's distinct prefixes packed once (with the
        runners-up beside its chain), and the positions and mask one forward verifies them with."""
        beams, trees, extra, runner_depth, drafts = self.packed_trees(plan)
        B, n = len(trees), max(len(t.tokens) for t in trees)
        tokens = np.zeros((B, n), dtype=np.int32)
        for b, tree in enumerate(trees):
            tokens[b, : len(tree.tokens)] = tree.tokens
        parents = [t.parents for t in trees]
        if self.valid.all() and all(np.array_equal(p, np.arange(-1, n - 1)) for p in parents):
            # Every row a chain (one beam; a plain step when every draft is cut) and no holes:
            # contiguous positions and the causal mask, as `ar` (and mlx-lm) run it.
            positions, mask = None, None
        else:
            positions = masks.ragged_tree_positions(self.lengths, parents, n)  # (B, N)
            if self.valid.all():  # no holes: a tail mask over the tree alone; every query sees the prefix
                mask = masks.tree_tail_mask(parents, n)  # (B, 1, N, N)
            else:
                mask = masks.ragged_tree_mask(self.valid, parents, n)  # (B, 1, N, P + N)
        index = to_device(np.stack([t.index for t in trees]).reshape(B, -1))  # (B, W*L)
        self.traffic.verify((B, n))
        return Tree(beams, trees, to_device(tokens), positions, mask, index, drafts, extra, runner_depth)

    def packed_trees(self, plan: Plan):
        """The host half of `pack`: -> the beams verified (B, W', L'), each row's `PackedTree`,
        runners-up verified per row (B,), the depth of each runner-up beam (R,), the drafts."""
        step_length, B = plan.step_length, len(self.rows)
        beams, owner = self.beams[:, :, :step_length], self.owner[:, :, :step_length]
        drafts = self.drafts if self.drafts.draft_probs is None else \
            self.drafts._replace(draft_probs=self.drafts.draft_probs[:, :, : step_length - 1])
        trees = [pack_beams(beams[b], owner[b]) for b in range(B)]
        self.tally["before"] += beams.size
        self.tally["after"] += sum(len(t.tokens) for t in trees)
        extra = np.zeros(B, dtype=np.int64)  # runners-up verified per row
        runner_depth = np.zeros(0, dtype=np.int64)  # of beam 1.. (the runners-up)
        if plan.with_runners and step_length > 1:
            beams, trees, extra, runner_depth = self.runners.add(beams, trees, plan.judged, step_length,
                                                                 self.source == self.fallback,
                                                                 int(self.lengths.max()), plan.runners)
        return beams, trees, extra, runner_depth, drafts

    def accept(self, tree: Tree, step_length: int, out):
        """The longest run of each row's drafts the target agrees with (the target's own token at
        each node: its argmax, or its sample), or rejection sampling over sampled chains; and the
        hidden state after the last accepted token (the head drafts from it)."""
        beams = to_device(tree.beams)
        B, W, L = beams.shape
        index, logits = tree.index, self.penalties.nodes(out.logits, tree.beams, tree.packed)  # (B, N, V)
        if not self.s.sampled_drafts:
            # The target's own token once per packed node, never per beam: a runner-up's beam
            # repeats its chain's prefix, and its nodes must see the same draws.
            targets = mx.take_along_axis(self.own_token(logits), index, axis=1)  # (B, W*L)
            result = greedy_accept_targets(beams, targets.reshape(B, W, L))
        else:
            beam_logits = mx.take_along_axis(logits, index[..., None], axis=1).reshape(B, W, L, -1)  # unpacked
            probs = target_probs(beam_logits, self.params.temperature, self.params.top_p)  # (B, W, L, V)
            q = tree.drafts.draft_probs  # (B, W, L-1, V)
            rows = [sampling_accept(beams[b], probs[b], q[b]) for b in range(B)]
            result = Accepted(*(mx.stack(list(field)) for field in zip(*rows)))
        flat = result.beam * step_length + result.num_accepted  # (B,) last accepted token, beam-major
        last = mx.take_along_axis(index, flat[:, None], axis=1)  # (B, 1) its packed position
        return result, mx.take_along_axis(out.hidden, last[..., None], axis=1)[:, 0]  # (B, D)

    def draft(self, tree: Tree, step_length: int, result: Accepted, hidden: mx.array) -> Read:
        """The next step's drafts, and the step's host sync. The head's are built lazily from the
        accepted path's hidden state; with no host-side source they are read with the acceptance
        in one sync. Host-side sources need the next own token on the host: the acceptance is
        read first (eager: with the head's drafts), the sources commit the step's text and offer
        their chains, and the head's drafts are read only where some row needs them."""
        after_text = self.head.keeps_text  # a draft model drafts after the step's text, read first
        drafts = None if after_text else self.head.propose(result.next_token, hidden)  # still lazy
        self.mark("draft_s", *(drafts[:2] if drafts else ()))
        if self.first_offer is None and not after_text:
            best, accepted, token, beams, owner, confidence = _read(
                result.beam, result.num_accepted, result.next_token, drafts.beams, drafts.owner, drafts.confidence)
            source = np.full(len(best), self.fallback)
        else:
            head_drafts = (drafts.beams, drafts.owner, drafts.confidence) if self.s.eager and drafts else ()
            best, accepted, token, *_ = _read(result.beam, result.num_accepted, result.next_token, *head_drafts)
            kept = [tree.beams[b, best[b], : accepted[b] + 1] for b in range(len(self.rows))]
            if after_text:
                self.head.commit(kept)
                drafts = self.head.propose(mx.array(token), hidden)
            if self.first_offer is None:
                beams, owner, confidence = _read(drafts.beams, drafts.owner, drafts.confidence)
                source = np.full(len(best), self.fallback)
            else:
                self.first_offer.commit(kept, verified=step_length - 1)
                drafts, beams, owner, confidence, source, _ = self.first_offer.draft(drafts, token)
        self.mark("sync_s")
        return Read(best, accepted, token, drafts, beams, owner, confidence, source)

    def commit(self, tree: Tree, step_length: int, read: Read) -> List[List[int]]:
        """The cache keeps each row's accepted tokens; each source's trust learns from its rows;
        the next step's drafts take over. -> the tokens each row commits."""
        s, best, accepted, token = self.s, read.best, read.accepted, read.token
        # The chains' drafts: where a runner-up (the beams after the W chains) at depth k was
        # accepted, the chain's first k-1 drafts were and its k-th was not.
        chains = tree.beams.shape[1] - len(tree.runner_depth)
        on_runner_up = best >= chains
        depth_of_best = np.concatenate([np.zeros(chains, dtype=np.int64), tree.runner_depth])[best]
        self.tally["runners_up_accepted"] += int(on_runner_up.sum())
        self.tally["runners_up_deeper_accepted"] += int((on_runner_up & (depth_of_best > 1)).sum())
        chain_best = np.where(on_runner_up, 0, best)
        chain_accepted = np.where(on_runner_up, np.minimum(accepted, depth_of_best - 1), accepted)
        # The head's own depths only: a head row padded to a host-side chain's length may accept padding.
        self.trusts[-1].update(self.beams[..., : s.length], self.confidence[..., : s.length - 1], chain_best,
                               np.minimum(chain_accepted, s.length - 1), token,
                               verified=min(step_length, s.length) - 1, rows=self.source == self.fallback)
        for i, trust in enumerate(self.trusts[:-1]):
            trust.update(self.beams, self.confidence, chain_best, chain_accepted, token, verified=step_length - 1,
                         rows=self.source == i)
        self.keep_accepted(tree, best, accepted)
        self.lengths = self.lengths + accepted + 1
        if self.meter is not None:
            self.meter.add(float(accepted.mean()) + 1, int(tree.tokens.shape[1]), int(self.lengths.max()))
        self.stats.forward_passes += 1
        from_host = self.source != self.fallback
        np.add.at(self.source_steps, self.source, 1)
        self.tally["lookup_steps"] += int(from_host.sum())
        self.tally["lookup_accepted"] += int(accepted[from_host].sum())
        new_tokens = []
        for b in range(len(self.rows)):
            self.tally["steps"] += 1
            if not from_host[b]:  # the head's acceptance by draft position
                self.per_position[: accepted[b]] += 1
            new_tokens.append([int(t) for t in tree.beams[b, best[b], 1: accepted[b] + 1]] + [int(token[b])])
        self.emitted += accepted + 1
        self.penalties.commit(new_tokens)
        self.tally["runners_up"] = self.runners.verified
        self.report()
        self.drafts, self.beams, self.owner, self.confidence, self.source = (
            read.drafts, read.beams, read.owner, read.confidence, read.source)
        return new_tokens

    def keep_accepted(self, tree: Tree, best: np.ndarray, accepted: np.ndarray) -> None:
        """The cache keeps each row's accepted path, packed from the committed offset (holes where
        a row kept fewer than the longest, marked in `valid`)."""
        kept = [tree.packed[b].index[best[b], : accepted[b] + 1] for b in range(len(self.rows))]
        physical = self.committed
        self.committed = self.cache.keep_appended_rows(physical, kept)
        new_valid = np.zeros((len(self.rows), self.committed - physical), dtype=bool)
        for b in range(len(self.rows)):
            new_valid[b, : accepted[b] + 1] = True
        self.valid = np.concatenate([self.valid, new_valid], axis=1)

    def deepen(self) -> None:
        """Stepwise chains: the head's rows drafted as deep as the next step can verify, the
        deepest `kept_length` of any row with the rows' current trust (a row is verified as deep
        as the batch's deepest kept row, so its drafts are made that deep too)."""
        s, head_rows = self.s, self.source == self.fallback
        if not self.head.stepwise or not head_rows.any():
            return
        host_judged = self.calibrated(self.confidence)[~head_rows]
        host_kept = kept_length(host_judged, s.cutoff) - 1 if len(host_judged) else 0
        head_trust = self.trusts[-1]

        def wanted(so_far: np.ndarray) -> bool:  # (B, 1, k): the head's drafts so far
            judged = head_trust.calibrated(so_far) if s.use_trust else so_far
            likely = np.all(judged >= s.cutoff, axis=-1)[:, 0] & (np.prod(judged, axis=-1)[:, 0] >= s.deepen_reach)
            return so_far.shape[-1] < host_kept or bool((likely & head_rows).any())

        deeper, confidence = self.head.extend(self.beams, self.confidence, head_rows, wanted)
        if deeper is self.beams:
            return
        self.owner = np.zeros_like(deeper)  # one chain per row: every prefix its own (dedup_prefix's answer)
        self.beams, self.confidence = deeper, confidence
        self.drafts = Proposal(to_device(deeper), to_device(self.owner), None, to_device(confidence))

    def close(self) -> None:
        """Stopped mid-step: drop the unverified tree."""
        if self.cache.offset > self.committed:
            self.cache.rollback_to(self.committed)
        if self.resumed is not None:  # the next turn of this conversation may resume from its prompt
            keep_prefix(self.ctx, self.cache, self.resumed)

    def calibrated(self, confidence: np.ndarray) -> np.ndarray:
        """confidence (B, W, L-1) -> each row's, times the row's trust in the source that drafted it."""
        if not self.s.use_trust:
            return confidence
        if not self.fallback:
            return self.trusts[0].calibrated(confidence)
        by_source = np.stack([trust.calibrated(confidence) for trust in self.trusts])  # (S, B, W, L-1)
        return np.take_along_axis(by_source, self.source[None, :, None, None], axis=0)[0]

    def own_token(self, logits: mx.array) -> mx.array:  # (..., V) -> (...) the target's own choice
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs, p = logits - mx.logsumexp(logits, axis=-1, keepdims=True), self.params
        if 0.0 < p.top_p < 1.0:  # a tree's nodes: the nucleus from the likeliest tokens, not a sort per node
            return sample_top_nucleus(logprobs, p.temperature, p.top_p, self.ctx.sampler)
        return self.ctx.sampler(logprobs)  # as `ar` draws

    def mark(self, name: str, *arrays) -> None:
        """Profile mode only: a deliberate extra sync per phase, to attribute time to it."""
        if not self.s.profile:
            return
        mx.eval(*arrays)
        now = time.perf_counter()
        self.timings[name] += now - self._t0
        self._t0 = now

    def report(self) -> None:
        steps, tally = self.tally["steps"], self.tally
        self.stats.extra.update(
            beam_width=self.s.width, beam_length=self.s.length,
            steps=steps,
            acceptance_per_position=[round(float(c) / max(1, steps - tally["lookup_steps"]), 3)
                                     for c in self.per_position],
            tree_tokens_before_dedup=tally["before"],
            tree_tokens_after_dedup=tally["after"],
            compression=round(1 - tally["after"] / tally["before"], 3) if tally["before"] else 0.0,
            draft_trust=[round(float(t), 3) for t in self.trusts[-1].trust],
            judged_drafts=self.trusts[-1].events,
            judged_for_free=self.trusts[-1].free_events,
            lookup_steps=round(tally["lookup_steps"] / steps, 3) if steps else 0.0,
            lookup_accepted_per_step=round(tally["lookup_accepted"] / max(1, tally["lookup_steps"]), 3),
            runners_up_verified=tally["runners_up"],
            runners_up_accepted=tally["runners_up_accepted"],
            runners_up_deeper_accepted=tally["runners_up_deeper_accepted"],
            source_steps=dict(zip(self.names, self.source_steps.tolist())),
            **self.traffic.figures(),
        )
        if self.s.profile:
            self.stats.extra.update({k: round(v, 4) for k, v in self.timings.items()})
