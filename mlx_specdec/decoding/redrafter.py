"""ReDrafter (Cheng et al. 2024): an RNN draft head on the target's last hidden state, beam search,
dynamic tree attention, verify the whole tree in one forward.

One decoding step, entered with the cache holding every committed token except the target's own
latest token `x`, and with the hidden state `h` that produced `x` (per batch row):

    draft   W beams of length L from (h, x): beam search (greedy) or W sampled chains (sampling);
            with --lookup N (default), a row whose text + x ends in an n-gram seen before drafts
            the N tokens that followed it instead (drafting/lookup.py)
    cut     keep each beam's leading drafts whose confidence, times the row's running trust in its
            source (drafting/calibration.py), clears the cutoff; of those, the depth with the most
            expected tokens per unit of verify cost at this context (drafting/verify_cost.py);
            none kept = a plain step   [host]
    pack    dedup shared prefixes -> N <= W*L distinct tokens, depths, tree mask      [host, tiny]
            (+ greedy chains: the head's runners-up as siblings of the chain's drafts, and its own
            first choices beside a lookup's, where the verify-cost table says they pay: --runners-up)
    verify  one forward of the N tokens at positions length + depth under the tree mask
    accept  longest run the target agrees with (greedy) or rejection sampling -> n, next token
    commit  the cache keeps the n+1 accepted tokens (keep_appended_rows: only the offset moves when
            they already lie first, as a chain's always do), drops the rest

The step's only host sync reads the acceptance result *and* the next step's drafts together: the
next draft is built lazily from the accepted path's hidden state before anything is read back.
With lookup the acceptance is read first (the lookup needs x on the host) and the head's lazy
drafts in a second sync (where every row found a lookup, only the first draft, verified beside
the lookup's: --head-beside-lookup). A greedy chain (the default) reads its first draft there and
each deeper one in a sync of its own, made only while the cutoff would keep the chain that deep
(`HeadProposer` stepwise: the same trees, fewer projections).
Before the first step the first tokens are read on their own and yielded, then the first draft
is built and read: like every method, ReDrafter's TTFT is prefill + the first token's forward,
and all drafting is decoding time. (`--prompt-draft on` drafts from the prompt instead, so the
first forward is a step: one forward fewer, a later first token; no faster end to end here.)

A batch of prompts runs as rows of one cache. Rows accept different numbers of tokens, so the
cache is ragged: every row is packed from the same physical offset and a row that kept fewer
tokens leaves holes, hidden from later queries by a per-row `valid` mask. One row has no holes.
"""

from __future__ import annotations

import time
from typing import Iterator

import mlx.core as mx
import numpy as np

from .. import masks
from ..acceptance import Accepted, greedy_accept_targets, sampling_accept, target_probs
from ..drafting.tree import pack_beams
from ..drafting import HeadProposer, Proposal, select_rows
from ..drafting.calibration import DraftTrust
from ..drafting.base import read_host as _read
from ..drafting.first_offer import FirstOffer
from ..drafting.lookup import PromptLookup
from ..drafting.runners_up import StepRunnersUp
from ..drafting.verify_cost import RateMeter, kept_length, worth_verifying
from ..errors import UserError
from ..model.forward import forward
from .base import DecodeContext, Step, drop_finished_rows, new_contiguous_cache, prefill_rows

# The best measured configuration on this CPU with the shipped head (benchmarks/results/
# issue18_redrafter_defaults.md, issue18_stop40.md, issue18_stop43.md): one chain, each draft verified
# only where the head gives it >= 0.1 (head v9: 0.1 and 0.2 ran at the same speed, 0.1 with 2-3 % more
# tokens a forward on both prompt sets). Wider trees accept more per forward but cost more than they
# accept here.
DEFAULT_BEAM_WIDTH = 1
# Up to 5 drafts; most steps verify fewer (the cutoff, the reach, the cost rule). L 6 against 5 on 8
# unseen chats at 96 tokens: 1.567x / 1.586x against 1.506x / 1.537x in two runs (1.983 against 1.966
# tokens a forward); on the project's prompts the two verify the same trees.
DEFAULT_BEAM_LENGTH = 6
DEFAULT_DRAFT_CUTOFF = 0.1  # verify only the drafts the head gives at least this probability
DEFAULT_DRAFT_TRUST = True  # ... times what it has earned in this answer (drafting/calibration.py)
# Prompt lookup first (drafting/lookup.py): where the text so far ends in a 2-4 token sequence seen
# before, draft the 4 tokens that followed it instead of the head's (benchmarks/results/
# issue18_lookup_unseen.md: 8 unseen chats, 64 tokens, 1.27x -> 1.33x; 256 tokens 1.24x -> 1.51x).
DEFAULT_LOOKUP = 4
DEFAULT_EAGER_DRAFTS = False  # lazy: drafts made and read only as deep as a step can verify
# Up to 2, where the verify-cost table says they pay: on the 2-core CPU +5 % tokens a forward
# (1.64 -> 1.72 on unseen chats at 64 tokens) at the same speed (six A/B runs, mean +0.4 %; the card).
DEFAULT_RUNNERS_UP = 2
# ... beside the chain's first two drafts, competing with the chain's deeper drafts for the verify's
# tokens (runners_up.plan_step). With the argmax taken once per packed token (not per beam position),
# depth 2 runs as fast as depth 1 and accepts more: 8 unseen chats, 96 tokens, 1.513-1.541x against
# 1.507-1.534x, 2.006 against 1.944 tokens a forward (benchmarks/results/issue18_stop43.md).
DEFAULT_RUNNERS_UP_DEPTHS = 2
DEFAULT_RUNNERS_COMPETE = True
DEFAULT_HEAD_BESIDE_LOOKUP = True  # ... and the head's first draft beside a lookup's (runners_up.py)
# Stepwise chains: draft one depth deeper only while some head row's chain so far is at least this
# likely to be accepted whole (the product of its calibrated confidences). The cutoff and the
# verify-cost rule judge what a draft costs to verify; this judges what it costs to make: a
# vocabulary projection and a sync, ~3 ms on the 2-core CPU, against ~19 ms a token is worth there
# (a ~37 ms step / ~1.95 tokens) times the ~55 % a reached draft is right: reach * 0.55 * 19 > 3
# -> reach > ~0.3 (a depth alone costs ~0.55 ms now). Measured: 0.25-0.35 best, 0.15 (results/
# issue18_stop41.md) and 0.08 (6 % slower, 2.029 against 2.006 tokens a forward: issue18_stop44.md) slower.
DEFAULT_DEEPEN_REACH = 0.25
DEFAULT_PROMPT_DRAFT = False
DEFAULT_VERIFY_COST = True  # verify the depth worth its cost at this context (drafting/verify_cost.py)
PHASES = ("draft_s", "pack_s", "verify_s", "accept_s", "sync_s")


class NoDrafter(UserError):
    pass


def redrafter(ctx: DecodeContext) -> Iterator[Step]:
    head = ctx.resources.get("drafter")
    if head is None:
        raise NoDrafter(f"redrafter needs a draft head for {ctx.lm.name}: pass --drafter DIR "
                        "(train one with `mlx-specdec train-drafter`)")
    width = int(ctx.params.options.get("beam_width", DEFAULT_BEAM_WIDTH))
    length = int(ctx.params.options.get("beam_length", DEFAULT_BEAM_LENGTH))
    profile = bool(ctx.params.options.get("profile", False))
    cutoff = float(ctx.params.options.get("draft_cutoff", DEFAULT_DRAFT_CUTOFF))
    use_trust = bool(ctx.params.options.get("draft_trust", DEFAULT_DRAFT_TRUST))
    lookup_drafts = int(ctx.params.options.get("lookup", DEFAULT_LOOKUP))
    # A cutoff of 0 asks for every draft: no cost judges them either.
    cost_rule = ctx.params.options.get("verify_cost", DEFAULT_VERIFY_COST)  # True, False or "margin"
    # This machine's verify-cost table (`mlx-specdec calibrate`), the shipped one on a CPU, or none.
    cost_table = ctx.resources.get("verify_costs")
    cost_aware = bool(cost_rule) and cost_table is not None and cutoff > 0
    meter = RateMeter(cost_table) if cost_aware and cost_rule == "margin" else None
    if width < 1 or length < 2:
        raise UserError("redrafter needs --beam-width >= 1 and --beam-length >= 2")
    if not 0.0 <= cutoff <= 1.0:
        raise UserError("redrafter needs --draft-cutoff between 0 and 1")
    model, stats, params = ctx.lm.model, ctx.stats, ctx.params
    embed = model.model.embed_tokens
    greedy = params.greedy
    eos = ctx.lm.eos_token_ids
    # Lazy (the default): greedy chains are drafted one depth at a time, only as deep as the cutoff
    # lets a step verify (drafting/head_source.py), and the head's drafts are read only where the lookup
    # found none: on the CPU each depth's vocabulary projection costs ~3 ms. Eager: every depth in one
    # graph, read with the acceptance in the step's one host sync; on an H200 the two tied (0.70x vs
    # 0.70x of `ar`; benchmarks/results/issue18_h200_cuda/), so the CPU's rule stays everywhere.
    # With no cutoff every draft is made in one graph.
    eager = bool(ctx.params.options.get("eager_drafts", DEFAULT_EAGER_DRAFTS))
    stepwise = bool(ctx.params.options.get("stepwise_draft", not eager)) and cutoff > 0
    # Runners-up (greedy, lazy chains): the head's 2nd..(S+1)th choices for the first draft, each a
    # sibling of it in the tree, where the verify-cost table says the extra query tokens pay.
    runners_up = int(ctx.params.options.get("runners_up", DEFAULT_RUNNERS_UP))
    runner_depths = int(ctx.params.options.get("runners_up_depths", DEFAULT_RUNNERS_UP_DEPTHS))
    deepen_reach = float(ctx.params.options.get("deepen_reach", DEFAULT_DEEPEN_REACH))
    prompt_draft = bool(ctx.params.options.get("prompt_draft", DEFAULT_PROMPT_DRAFT))
    compete = bool(ctx.params.options.get("runners_compete", DEFAULT_RUNNERS_COMPETE)) and meter is None
    beside_lookup = bool(ctx.params.options.get("head_beside_lookup", DEFAULT_HEAD_BESIDE_LOOKUP)) and lookup_drafts > 0
    proposer = HeadProposer(head, embed, width, length, vocab=int(model.args.vocab_size),
                            temperature=0.0 if greedy else params.temperature, stepwise=stepwise,
                            runners_up=runners_up, runner_depths=runner_depths)
    vocab = int(model.args.vocab_size)
    lookup = FirstOffer([PromptLookup(lookup_drafts, vocab)], vocab) if lookup_drafts > 0 else None

    def own_token(logits: mx.array) -> mx.array:  # (B, V) -> (B,) the target's own choice
        if greedy:
            return mx.argmax(logits, axis=-1)
        return ctx.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))  # as `ar` draws

    def accept(beams: mx.array, logits: mx.array, index: mx.array, drafts: Proposal) -> Accepted:
        """beams (B, W, L); logits (B, N, V) at the packed tree's tokens; index (B, W*L) each beam
        token's packed position."""
        B, W, L = beams.shape
        if greedy:  # the argmax once per packed token (a runner-up's beam repeats its chain's prefix)
            targets = mx.take_along_axis(mx.argmax(logits, axis=-1), index, axis=1)  # (B, W*L)
            return greedy_accept_targets(beams, targets.reshape(B, W, L))
        beam_logits = mx.take_along_axis(logits, index[..., None], axis=1).reshape(B, W, L, -1)  # unpacked
        probs = target_probs(beam_logits, params.temperature, params.top_p)  # (B, W, L, V)
        q = drafts.draft_probs  # (B, W, L-1, V)
        rows = [sampling_accept(beams[b], probs[b], q[b]) for b in range(beams.shape[0])]
        return Accepted(*(mx.stack(list(field)) for field in zip(*rows)))

    timings = dict.fromkeys(PHASES, 0.0)
    per_position = np.zeros(length - 1, dtype=np.int64)  # row-steps that accepted >= k+1 drafts
    tally = {"steps": 0, "before": 0, "after": 0, "lookup_steps": 0, "lookup_accepted": 0,
             "runners_up": 0, "runners_up_accepted": 0, "runners_up_deeper_accepted": 0}

    def deepen(drafts: Proposal, beams, owner, confidence, from_lookup):
        """Stepwise chains: the head's rows drafted as deep as the next step can verify, the
        deepest `kept_length` of any row with the rows' current trust (a row is verified as deep as
        the batch's deepest kept row, so its drafts are made that deep too); as read otherwise."""
        if not proposer.stepwise or from_lookup.all():
            return drafts, beams, owner, confidence
        head_rows = ~from_lookup
        lookup_judged = lookup_trust.calibrated(confidence) if use_trust else confidence
        lookup_kept = kept_length(lookup_judged[from_lookup], cutoff) - 1 if from_lookup.any() else 0

        def wanted(so_far: np.ndarray) -> bool:  # (B, 1, k): the head's drafts so far
            judged = trust.calibrated(so_far) if use_trust else so_far
            likely = np.all(judged >= cutoff, axis=-1)[:, 0] & (np.prod(judged, axis=-1)[:, 0] >= deepen_reach)
            return so_far.shape[-1] < lookup_kept or bool((likely & head_rows).any())

        deeper, deeper_confidence = proposer.extend(beams, confidence, head_rows, wanted)
        if deeper is beams:
            return drafts, beams, owner, confidence
        owner = np.zeros_like(deeper)  # one chain per row: every prefix its own (dedup_prefix's answer)
        return (Proposal(mx.array(deeper), mx.array(owner), None, mx.array(deeper_confidence)),
                deeper, owner, deeper_confidence)

    def mark(name: str, since: float, *arrays) -> float:
        """Profile mode only: a deliberate extra sync per phase, to attribute time to it."""
        if not profile:
            return since
        mx.eval(*arrays)
        now = time.perf_counter()
        timings[name] += now - since
        return now

    # -- prefill, and the target's first token (or the first step) ------------------------------
    prompts = ctx.prompts or [ctx.prompt]
    rows, keep = list(range(len(prompts))), None  # live rows' thread ids
    cache = new_contiguous_cache(ctx)
    # --prompt-draft: the last prompt token is the step's own token and the hidden state before it
    # drafts, so the first forward verifies drafts too (needs two prompt tokens in every row).
    from_prompt = prompt_draft and min(len(p) for p in prompts) >= 2
    valid, hidden = prefill_rows(ctx, cache, [p[:-1] for p in prompts], last_hidden=True) if from_prompt else \
        (prefill_rows(ctx, cache, [p[:-1] for p in prompts]), None)  # (B, P), (B, D)
    lengths = np.array([len(p) - 1 for p in prompts])  # committed tokens per row
    emitted = np.zeros(len(rows), dtype=np.int64)
    own = np.array([p[-1] for p in prompts])  # the target's own latest token per row, on the host
    token = mx.array(own)
    if not from_prompt:
        out = forward(model, token[:, None], cache, positions=masks.ragged_tree_positions(lengths, [[-1]] * len(rows), 1),
                      mask=masks.ragged_tree_mask(valid, [[-1]] * len(rows), 1))
        valid = np.concatenate([valid, np.ones((len(rows), 1), dtype=bool)], axis=1)
        lengths += 1
        token, hidden = own_token(out.logits[:, -1]), out.hidden[:, -1]
        # Host sync: the first tokens alone, yielded before any drafting. TTFT ends here, as for every
        # method (prefill + the forward of the last prompt token); the first draft is decoding time.
        own = _read(token)[0]
        stats.forward_passes += 1
        for b in rows:
            yield Step([int(own[b])], thread_id=b)
        emitted += 1
        rows, keep = drop_finished_rows(rows, [[int(t)] for t in own], emitted, eos, params.max_tokens, ctx.stopped_rows)
    committed = cache.offset
    trust = DraftTrust(len(prompts))  # in the head's confidence
    runners = StepRunnersUp(proposer, trust.calibrated if use_trust else (lambda c: c), cutoff,
                            cost_table if cost_aware else None, compete, beside_lookup)
    lookup_trust = DraftTrust(len(prompts))  # in the lookup's measured acceptance
    from_lookup = np.zeros(len(prompts), dtype=bool)  # per prompt, as `keep` indexes them
    if lookup is not None:
        lookup.begin([p[:-1] for p in prompts] if from_prompt else prompts)  # the text before `own`
    if rows:  # the first draft, from the hidden state that produced the own tokens
        drafts = proposer.propose(token, hidden)
        if lookup is None:
            beams, owner, confidence = _read(drafts.beams, drafts.owner, drafts.confidence)  # host sync: the first drafts
        else:
            drafts, beams, owner, confidence, _, from_lookup = lookup.draft(drafts, own)
        drafts, beams, owner, confidence = deepen(drafts, beams, owner, confidence, from_lookup)
    try:
        while rows:
            if keep is not None:  # some rows finished: they leave the batch
                cache.select_rows(keep)
                valid, lengths, beams, owner, confidence, emitted, from_lookup = (
                    a[keep] for a in (valid, lengths, beams, owner, confidence, emitted, from_lookup))
                drafts = select_rows(drafts, keep)
                proposer.select_rows(keep)
                trust.select_rows(keep)
                lookup_trust.select_rows(keep)
                if lookup is not None:
                    lookup.select_rows(keep)
            t0 = time.perf_counter()
            # Draft only where it is likely: this step verifies the drafts up to the deepest one
            # (over beams and rows) that every draft before it in its beam clears the cutoff; the
            # rest are cut from the tree. A step with none is a plain step (cost 1, not ~1.5).
            # Each source's confidence is calibrated by the row's trust in that source.
            judged = np.where(from_lookup[:, None, None], lookup_trust.calibrated(confidence),
                              trust.calibrated(confidence)) if use_trust else confidence
            step_length = kept_length(judged, cutoff)
            planned, with_runners = None, proposer.runners_up and step_length > 1 and (beside_lookup or not from_lookup.all())
            if with_runners and runners.compete:
                # ... the chain's drafts and the runners-up beside them, the likeliest first, as many
                # as are worth this context's verify cost
                step_length, planned = runners.plan(beams, judged, step_length, ~from_lookup, int(lengths.max()))
            elif cost_aware:  # ... and no deeper than the drafts are worth at this context's verify cost
                step_length = worth_verifying(judged, owner, step_length, int(lengths.max()),
                                              rate=meter.rate if meter is not None else None, table=cost_table)
            drafted_beams, drafted_confidence = beams, confidence  # before the cut: judged after the step
            beams, owner = beams[:, :, :step_length], owner[:, :, :step_length]
            step_drafts = drafts if drafts.draft_probs is None else \
                drafts._replace(draft_probs=drafts.draft_probs[:, :, : step_length - 1])
            trees = [pack_beams(beams[b], owner[b]) for b in range(len(rows))]
            tally["before"] += beams.size
            tally["after"] += sum(len(t.tokens) for t in trees)
            extra = np.zeros(len(rows), dtype=np.int64)  # runners-up verified per row
            runner_depth = np.zeros(0, dtype=np.int64)  # of beam 1.. (the runners-up)
            if with_runners and step_length > 1:
                beams, trees, extra, runner_depth = runners.add(beams, trees, judged, step_length, ~from_lookup,
                                                                int(lengths.max()), planned)
            n = max(len(t.tokens) for t in trees)
            tokens = np.zeros((len(rows), n), dtype=np.int32)
            for b, tree in enumerate(trees):
                tokens[b, : len(tree.tokens)] = tree.tokens
            parents = [t.parents for t in trees]
            if valid.all() and all(np.array_equal(p, np.arange(-1, n - 1)) for p in parents):
                # Every row a chain (one beam; a plain step when every draft is cut) and no holes:
                # contiguous positions and the causal mask, as `ar` (and mlx-lm) run it.
                positions, mask = None, None
            else:
                positions = masks.ragged_tree_positions(lengths, parents, n)  # (B, N)
                if valid.all():  # no holes: a tail mask over the tree alone; every query sees the prefix
                    mask = masks.tree_tail_mask(parents, n)  # (B, 1, N, N)
                else:
                    mask = masks.ragged_tree_mask(valid, parents, n)  # (B, 1, N, P + N)
            index = mx.array(np.stack([t.index for t in trees]).reshape(len(rows), -1))  # (B, W*L)
            t0 = mark("pack_s", t0)

            out = forward(model, mx.array(tokens), cache, positions=positions, mask=mask)
            t0 = mark("verify_s", t0, out.logits)

            result = accept(mx.array(beams), out.logits, index, step_drafts)
            flat = result.beam * step_length + result.num_accepted  # (B,) last accepted token, beam-major
            last = mx.take_along_axis(index, flat[:, None], axis=1)  # (B, 1) its packed position
            hidden = mx.take_along_axis(out.hidden, last[..., None], axis=1)[:, 0]  # (B, D)
            t0 = mark("accept_s", t0, result, hidden)

            drafts = proposer.propose(result.next_token, hidden)  # the next step, still lazy
            t0 = mark("draft_s", t0, drafts.beams, drafts.owner)

            if lookup is None:
                # The one host sync of the step: acceptance results + the next step's drafts and owners.
                best, accepted, token, next_beams, next_owner, next_confidence = _read(
                    result.beam, result.num_accepted, result.next_token, drafts.beams, drafts.owner, drafts.confidence)
            else:
                # Host sync: the acceptance results; the lookup needs the next own token on the host.
                # Eager: the head's drafts come along, so the lookup reads them without a sync.
                head_drafts = (drafts.beams, drafts.owner, drafts.confidence) if eager else ()
                best, accepted, token, *_ = _read(result.beam, result.num_accepted, result.next_token, *head_drafts)
                lookup.commit([beams[b, best[b], : accepted[b] + 1] for b in range(len(rows))], verified=step_length - 1)
                drafts, next_beams, next_owner, next_confidence, _, next_from_lookup = lookup.draft(drafts, token)
            mark("sync_s", t0)

            # The chains' drafts: where a runner-up (the beams after the W chains) at depth k was
            # accepted, the chain's first k-1 drafts were and its k-th was not.
            chains = beams.shape[1] - len(runner_depth)
            on_runner_up = best >= chains
            tally["runners_up_accepted"] += int(on_runner_up.sum())
            depth_of_best = np.concatenate([np.zeros(chains, dtype=np.int64), runner_depth])[best]
            tally["runners_up_deeper_accepted"] += int((on_runner_up & (depth_of_best > 1)).sum())
            chain_best = np.where(on_runner_up, 0, best)
            chain_accepted = np.where(on_runner_up, np.minimum(accepted, depth_of_best - 1), accepted)
            # The head's own depths only: a head row padded to a lookup row's length may accept padding.
            trust.update(drafted_beams[..., :length], drafted_confidence[..., : length - 1], chain_best,
                         np.minimum(chain_accepted, length - 1), token, verified=min(step_length, length) - 1,
                         rows=~from_lookup)
            lookup_trust.update(drafted_beams, drafted_confidence, chain_best, chain_accepted, token,
                                verified=step_length - 1, rows=from_lookup)
            kept = [trees[b].index[best[b], : accepted[b] + 1] for b in range(len(rows))]
            physical = committed
            committed = cache.keep_appended_rows(physical, kept)
            new_valid = np.zeros((len(rows), committed - physical), dtype=bool)
            for b in range(len(rows)):
                new_valid[b, : accepted[b] + 1] = True
            valid = np.concatenate([valid, new_valid], axis=1)
            lengths = lengths + accepted + 1
            if meter is not None:
                meter.add(float(accepted.mean()) + 1, n, int(lengths.max()))
            stats.forward_passes += 1
            new_tokens = []
            tally["lookup_steps"] += int(from_lookup.sum())
            tally["lookup_accepted"] += int(accepted[from_lookup].sum())
            for b, thread in enumerate(rows):
                tally["steps"] += 1
                if not from_lookup[b]:  # the head's acceptance by draft position
                    per_position[: accepted[b]] += 1
                new_tokens.append([int(t) for t in beams[b, best[b], 1 : accepted[b] + 1]] + [int(token[b])])
            emitted += accepted + 1
            tally["runners_up"] = runners.verified
            _report(stats, width, length, tally, per_position, timings, profile, trust)
            if lookup is not None:
                from_lookup = next_from_lookup
            t0 = time.perf_counter()
            drafts, beams, owner, confidence = deepen(drafts, next_beams, next_owner, next_confidence, from_lookup)
            mark("draft_s", t0)
            for b, thread in enumerate(rows):
                yield Step(new_tokens[b], thread_id=thread, drafted=step_length - 1 + int(extra[b]),
                           accepted=int(accepted[b]))
            rows, keep = drop_finished_rows(rows, new_tokens, emitted, eos, params.max_tokens, ctx.stopped_rows)
    finally:
        if cache.offset > committed:  # stopped mid-step: drop the unverified tree
            cache.rollback_to(committed)


def _report(stats, width, length, tally, per_position, timings, profile, trust) -> None:
    steps = tally["steps"]
    stats.extra.update(
        beam_width=width,
        beam_length=length,
        steps=steps,
        acceptance_per_position=[round(float(c) / max(1, steps - tally["lookup_steps"]), 3) for c in per_position],
        tree_tokens_before_dedup=tally["before"],
        tree_tokens_after_dedup=tally["after"],
        compression=round(1 - tally["after"] / tally["before"], 3) if tally["before"] else 0.0,
        draft_trust=[round(float(t), 3) for t in trust.trust],
        judged_drafts=trust.events,
        judged_for_free=trust.free_events,
        lookup_steps=round(tally["lookup_steps"] / steps, 3) if steps else 0.0,
        lookup_accepted_per_step=round(tally["lookup_accepted"] / tally["lookup_steps"], 3)
        if tally["lookup_steps"] else 0.0,
        runners_up_verified=tally["runners_up"],
        runners_up_accepted=tally["runners_up_accepted"],
        runners_up_deeper_accepted=tally["runners_up_deeper_accepted"],
    )
    if profile:
        stats.extra.update({k: round(v, 4) for k, v in timings.items()})
