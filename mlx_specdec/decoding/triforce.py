"""TriForce (Sun et al. 2024): hierarchical speculation for long contexts.

Three levels, as Algorithm 1 of the paper, with the target model at the two upper ones:

    bottom  drafts up to γ1 tokens for the middle level (`--bottom`): n-gram prompt lookup
            (free), a small same-tokenizer model over a StreamingLLM cache (`model`, needs
            `--draft-model`), the ReDrafter head on the middle level's hidden state
            (`redrafter`), or nothing (`none`: the middle level writes one token per forward)
    middle  the target over the retrieval cache (`cache/retrieval.py`: the prompt's best chunks,
            `budget` keys) verifies the bottom's drafts and collects γ2 tokens: a proposer of
            the drafting layer (`drafting/middle.py`) for the top level
    top     the target over the full cache verifies those γ2 tokens in one forward: the longest
            prefix it accepts, then its own next token

Both verifies use the shared acceptance rule (`acceptance.py`). Greedy: the top level decides
every token, so the output is the target's own (`ar`'s). Sampling, exact at both levels:
    middle  a bottom draft x~ drawn from q is accepted with min(1, p^(x~)/q(x~)); on a rejection
            the token comes from norm(max(0, p^ - q)) (line 13 of Algorithm 1, CORRECT(q, p^);
            the reference code samples from p^ there, which skews what it hands up). Every token
            the middle level writes is therefore distributed as p^, the row handed up with it.
    top     each collected token is accepted with min(1, p(x)/p^(x)), else the next token comes
            from norm(max(0, p - p^)); all accepted: a bonus token from p. Output ~ the target's
            own sampling (`ar`'s distribution).

Penalties (frequency, presence, repetition) change p and p^ alike: at both levels each position is
penalized by its own text, the prompt, the answer and the chain before it (`penalties.ChainPenalties`),
so greedy stays `ar`'s answer with the same penalties and sampling follows the penalized target.

After each top verify the retrieval cache forgets its own tokens and takes the accepted ones'
keys and values from the full cache (as the reference code copies them), so both caches hold
the same text, and the bottom's text is cut back to what the top level committed. The
retrieval cache is built from the last prompt token's queries, and rebuilt (`--rebuild-stride`,
`--rebuild-below`) from the last committed token's queries over the prompt, with the generated
text kept whole (the reference code never rebuilds). The first build scores with the queries of
the last `--score-window` prompt tokens, the question rather than the chat template's last token.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

import mlx.core as mx

from ..cache import QueryRecorder, RetrievalKVCache
from ..cache.retrieval import attention_recall
from ..drafting.middle import Bottom, ChainVerifier, MiddleLevelProposer
from ..errors import UserError
from ..host_traffic import Tally
from ..model.forward import forward
from ..penalties import for_chain
from .base import DecodeContext, Step, keep_prefix, prefilled_cache
from .triforce_bottom import BOTTOMS, DEFAULT_BOTTOM, make_bottom  # noqa: F401  (BOTTOMS: the choices)

DEFAULT_BUDGET = 512  # retrieved prompt keys per KV head
DEFAULT_GAMMA = 6  # tokens the middle level collects per top verify (γ2)
DEFAULT_DRAFT = 3  # tokens the bottom level drafts per middle verify (γ1)
# The last prompt tokens whose queries score the chunks (the paper uses 1): the question rather
# than the chat template's last token.
DEFAULT_SCORE_WINDOW = 16
DEFAULT_MIDDLE_CACHE = "retrieval"
DEFAULT_REBUILD_STRIDE = 0  # rebuild the retrieval cache every this many tokens (0: never)
DEFAULT_REBUILD_BELOW = 0.0  # ... or when the rolling middle acceptance falls below this (0: never)
DEFAULT_SCORE_REDUCE = "mean"  # how a chunk's score pools the query heads of a KV group (mean or max)
ROLLING_ROUNDS = 8  # rounds in the rolling middle acceptance that `rebuild_below` watches
MIDDLE_CACHES = ("retrieval", "streaming")


def _settings(ctx: DecodeContext) -> dict:
    options = ctx.params.options
    s = dict(budget=int(options.get("budget", DEFAULT_BUDGET)), gamma=int(options.get("gamma", DEFAULT_GAMMA)),
             draft_length=int(options.get("draft_length", DEFAULT_DRAFT)),
             bottom=str(options.get("bottom", DEFAULT_BOTTOM)),
             middle_cache=str(options.get("middle_cache", DEFAULT_MIDDLE_CACHE)),
             rebuild_stride=int(options.get("rebuild_stride", DEFAULT_REBUILD_STRIDE)),
             rebuild_below=float(options.get("rebuild_below", DEFAULT_REBUILD_BELOW)),
             score_window=int(options.get("score_window", DEFAULT_SCORE_WINDOW)),
             score_reduce=str(options.get("score_reduce", DEFAULT_SCORE_REDUCE)))
    if s["score_reduce"] not in ("mean", "max"):
        raise UserError(f"--score-reduce is mean or max, not {s['score_reduce']!r}")
    if s["middle_cache"] not in MIDDLE_CACHES:
        raise UserError(f"--middle-cache is {' or '.join(MIDDLE_CACHES)}, not {s['middle_cache']!r}")
    if s["budget"] < 16 or s["gamma"] < 1 or s["draft_length"] < 1 or s["score_window"] < 1:
        raise UserError("triforce needs --budget >= 16, --gamma >= 1 and --draft-length >= 1")
    if s["rebuild_stride"] < 0 or not 0.0 <= s["rebuild_below"] <= 1.0:
        raise UserError("triforce needs --rebuild-stride >= 0 and --rebuild-below between 0 and 1")
    return s


def triforce(ctx: DecodeContext) -> Iterator[Step]:
    s = _settings(ctx)
    model, stats, prompt = ctx.lm.model, ctx.stats, ctx.prompt
    gamma = s["gamma"]
    # before the prefill, so that a missing draft model or head costs no long prefill
    vocab = ctx.lm.model.model.embed_tokens.weight.shape[0]
    bottom = Bottom(make_bottom(s["bottom"], ctx, s["draft_length"], vocab), vocab, sampling=not ctx.params.greedy)
    penalties = for_chain(ctx.params, len(prompt), vocab)  # None: every penalty off

    window = min(s["score_window"], len(prompt))
    full = prefilled_cache(ctx, prompt[:-window])  # resumed from the last turn's prompt in a chat
    recorder = QueryRecorder(full)  # the last prompt tokens' queries score the prompt's chunks
    first = forward(model, mx.array(prompt[-window:])[None], recorder, logits_for="last")
    logits = first.logits[:, -1]  # (1, V)
    if penalties is not None:
        logits = penalties.first(logits, prompt)
    token = int(ctx.sampler(logits - mx.logsumexp(logits, keepdims=True)).item())  # host sync
    hidden = first.hidden[:, -1]  # (1, D): the state that wrote `token` (the ReDrafter head reads it)
    stats.forward_passes += 1

    def build(queries, query_index=-1) -> RetrievalKVCache:  # an index or a slice of tokens
        return RetrievalKVCache.build(full, queries, s["budget"], prompt_length=len(prompt),
                                      query_index=query_index, policy=s["middle_cache"],
                                      reduce=s["score_reduce"])

    middle_cache = build(recorder.queries(), query_index=slice(None))
    # how much of the last prompt token's attention the kept positions hold (one softmax over
    # the prompt per layer, once): what a budget sees
    recall = attention_recall(recorder.queries(), full, middle_cache.positions)
    top = ChainVerifier(model, full, ctx.params, penalties)
    middle = MiddleLevelProposer(model, full, middle_cache, bottom, gamma, ctx.params, penalties)
    text = list(prompt) + [token]  # the prompt and the answer, the next token to verify last
    middle.begin([prompt])
    counts = dict(top_drafted=0, top_accepted=0, top_forwards=0, rebuilds=0)
    rolling = deque(maxlen=ROLLING_ROUNDS)  # per round: accepted / drafted at the top verify
    since_build = 0
    yield Step([token])

    def report() -> None:
        c = counts
        stats.extra.update(
            budget=middle.cache.budget, bottom=s["bottom"], gamma=gamma, middle_cache=s["middle_cache"],
            bottom_acceptance=round(middle.accepted / max(middle.drafted, 1), 3),
            middle_acceptance=round(c["top_accepted"] / max(c["top_drafted"], 1), 3),
            tokens_per_full_forward=round((c["top_accepted"] + c["top_forwards"]) / max(c["top_forwards"], 1), 3),
            middle_forwards=middle.forwards, retrieval_rebuilds=c["rebuilds"], attention_recall=round(recall, 3),
            **traffic.figures())

    traffic = Tally()  # per top-level verify: reads, host-built arrays, shapes (the middle's rounds included)
    try:
        while True:
            drafts, handed_up = middle.collect(token, hidden)
            due = (s["rebuild_stride"] and since_build >= s["rebuild_stride"]) or (
                s["rebuild_below"] and len(rolling) == rolling.maxlen
                and sum(rolling) / len(rolling) < s["rebuild_below"])
            scorer = QueryRecorder(full) if due else None  # this verify's queries score the rebuild
            top.cache = scorer or full
            n, following, _, states = top.verify([token] + drafts, handed_up, text)
            text += drafts[:n] + [following]
            hidden = states[:, n]
            top.cache = full
            stats.forward_passes += 1
            counts["top_forwards"] += 1
            traffic.verify((1, 1 + len(drafts)))
            counts["top_drafted"] += len(drafts)
            counts["top_accepted"] += n
            rolling.append(n / len(drafts))
            middle.judged([len(drafts)], [n])
            full.trim(len(drafts) - n)  # keep the last token and the accepted drafts
            since_build += 1 + n
            # both levels continue from the same text: the middle cache drops what it wrote this
            # round and takes the full cache's entries of the committed tokens
            middle.commit([[token] + drafts[:n]])
            if due:  # scored by the last committed token's queries (fed[n]) over the prompt
                middle.use_cache(build(scorer.queries(), query_index=n))
                counts["rebuilds"] += 1
                since_build = 0
                rolling.clear()
            token = following
            report()
            yield Step(drafts[:n] + [token], drafted=len(drafts), accepted=n)
    finally:
        mx.eval(full.state)
        keep_prefix(ctx, full, prompt[:-1])  # the full cache holds the whole prompt
