"""TriForce (Sun et al. 2024): hierarchical speculation for long contexts, greedy for now.

Three levels, as Algorithm 1 of the paper, with the target model at the two upper ones:

    bottom  drafts γ1 tokens for the middle level: n-gram prompt lookup (`--bottom ngram`, free)
            or nothing (`--bottom none`: the middle level writes one token per forward)
    middle  the target over the retrieval cache (`cache/retrieval.py`: the prompt's best chunks,
            `budget` keys) verifies the bottom's drafts and collects γ2 tokens
    top     the target over the full cache verifies those γ2 tokens in one forward: the longest
            prefix it agrees with, then its own next token

The top level decides every token, so greedy output is the target's own (`ar`'s). After each
top verify the retrieval cache forgets its own tokens and takes the accepted ones' keys and
values from the full cache (as the reference code copies them), so both caches hold the same
text. The retrieval cache is built once from the last prompt token's queries (the reference
never rebuilds it either).

Sampling (exact at both levels, line 13 of Algorithm 1) is not built yet: temperature > 0 is
refused with one clear line.
"""

from __future__ import annotations

from typing import Iterator, List

import mlx.core as mx

from ..acceptance import greedy_accept
from ..cache import QueryRecorder, RetrievalKVCache
from ..drafting import NgramProposer
from ..errors import UserError
from ..model.forward import forward
from .base import DecodeContext, Step, new_contiguous_cache, prefill

DEFAULT_BUDGET = 512  # retrieved prompt keys per KV head
DEFAULT_GAMMA = 6  # tokens the middle level collects per top verify (γ2)
DEFAULT_DRAFT = 3  # tokens the bottom level drafts per middle verify (γ1)
BOTTOMS = ("ngram", "none")


def _verify(model, cache, fed: List[int]):
    """One forward of `fed` (the last token, then drafts) over `cache`, accepted by the shared
    greedy rule (`acceptance.greedy_accept`, one beam): (drafts accepted, the target's own next
    token). The one host sync of a verify."""
    logits = forward(model, mx.array([fed]), cache, logits_for="all").logits  # (1, L, V)
    result = greedy_accept(mx.array([fed]), logits)  # beams (1, L): one beam of L tokens
    n, token = (int(v) for v in _read(result.num_accepted, result.next_token))
    return n, token


def _read(*arrays):
    mx.eval(*arrays)  # host sync
    return [a.item() for a in arrays]


def triforce(ctx: DecodeContext) -> Iterator[Step]:
    options, model, stats = ctx.params.options, ctx.lm.model, ctx.stats
    budget = int(options.get("budget", DEFAULT_BUDGET))
    gamma = int(options.get("gamma", DEFAULT_GAMMA))
    draft_length = int(options.get("draft_length", DEFAULT_DRAFT))
    bottom = str(options.get("bottom", "ngram"))
    if not ctx.params.greedy:
        raise UserError("triforce decodes greedily for now (exact sampling at both levels is not built yet): "
                        "use --temp 0")
    if bottom not in BOTTOMS:
        raise UserError(f"--bottom is {' or '.join(BOTTOMS)}, not {bottom!r}")
    if budget < 16 or gamma < 1 or draft_length < 1:
        raise UserError("triforce needs --budget >= 16, --gamma >= 1 and --draft-length >= 1")

    full = new_contiguous_cache(ctx)
    prompt = ctx.prompt
    prefill(ctx, full, prompt[:-1])
    recorder = QueryRecorder(full)  # the last prompt token's queries score the prompt's chunks
    logits = forward(model, mx.array(prompt[-1:])[None], recorder, logits_for="last").logits
    token = int(mx.argmax(logits[0, -1]).item())  # host sync: the first token
    stats.forward_passes += 1
    middle = RetrievalKVCache.build(full, recorder.queries(), budget)
    proposer = NgramProposer(1, draft_length + 1, vocab=int(logits.shape[-1])) if bottom == "ngram" else None
    # (the lookup text holds only what the top level committed: a middle round's own tokens are
    # speculative until the full-cache verify)
    if proposer is not None:
        proposer.begin([prompt])
    counts = {"middle_forwards": 0, "bottom_drafted": 0, "bottom_accepted": 0, "top_drafted": 0,
              "top_accepted": 0, "top_forwards": 0}
    yield Step([token])

    def report() -> None:
        stats.extra.update(
            budget=middle.budget, bottom=bottom, gamma=gamma,
            bottom_acceptance=round(counts["bottom_accepted"] / max(counts["bottom_drafted"], 1), 3),
            middle_acceptance=round(counts["top_accepted"] / max(counts["top_drafted"], 1), 3),
            tokens_per_full_forward=round((counts["top_accepted"] + counts["top_forwards"])
                                          / max(counts["top_forwards"], 1), 3),
            middle_forwards=counts["middle_forwards"], retrieval_rebuilds=0)

    def middle_drafts(start: int) -> List[int]:
        """γ2 tokens after `start`, written by the target over the retrieval cache (with the
        bottom's drafts verified γ1 at a time). The middle cache keeps them: the caller trims."""
        drafts: List[int] = []
        x = start
        while len(drafts) < gamma:
            found = proposer.continuations(0, x) if proposer is not None else []  # host-side lookup
            candidates = found[0] if found else []  # no match: the middle level writes one token
            n, own = _verify(model, middle, [x] + candidates)  # the middle verify
            counts["middle_forwards"] += 1
            counts["bottom_drafted"] += len(candidates)
            counts["bottom_accepted"] += n
            middle.trim(len(candidates) - n)  # fed x and the candidates: keep x and the accepted
            written = candidates[:n] + [own]
            drafts += written
            x = written[-1]
        return drafts[:gamma]

    try:
        while True:
            committed = middle.layers[0].own  # the middle cache's tokens the top level has committed
            drafts = middle_drafts(token)
            # The top level: one forward of the full cache over the last token and the drafts.
            n, following = _verify(model, full, [token] + drafts)
            stats.forward_passes += 1
            counts["top_forwards"] += 1
            counts["top_drafted"] += len(drafts)
            counts["top_accepted"] += n
            full.trim(len(drafts) - n)  # keep the last token and the accepted drafts
            kept = 1 + n
            # The middle cache drops what it wrote this round and takes the full cache's entries of
            # the newly committed tokens, so both levels continue from the same text.
            middle.trim(middle.layers[0].own - committed)
            end = full.offset
            for mid, top in zip(middle.layers, full.layers):
                mid.update_and_fetch(top.keys[..., end - kept:end, :], top.values[..., end - kept:end, :])
            if middle.offset != full.offset:  # both hold the prompt and every committed token
                raise RuntimeError(f"triforce: retrieval cache at {middle.offset}, full cache at {full.offset}")
            if proposer is not None:  # the lookup text is the text the top level committed
                proposer.commit([[token] + drafts[:n]])
            token = following
            report()
            yield Step(drafts[:n] + [token], drafted=len(drafts), accepted=n)
    finally:
        mx.eval(full.state)

