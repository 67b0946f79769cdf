"""ReDrafter (Cheng et al. 2024): an RNN draft head on the target's last hidden state, beam search,
dynamic tree attention, verify the whole tree in one forward.

One decoding step, entered with the cache holding every committed token except the target's own
latest token `x`, and with the hidden state `h` that produced `x`:

    draft   W beams of length L from (h, x): beam search (greedy) or W sampled chains (sampling)
    pack    dedup shared prefixes -> N <= W*L distinct tokens, depths, tree mask      [host, tiny]
    verify  one forward of the N tokens at positions offset + depth under the tree mask
    accept  longest run the target agrees with (greedy) or rejection sampling -> n, bonus token
    commit  the cache keeps the n+1 accepted tokens (keep_appended), drops the rest

The step's only host sync reads the acceptance result *and* the next step's drafts together: the
next draft is built lazily from the accepted path's hidden state before anything is read back.
"""

from __future__ import annotations

import time
from typing import Iterator

import mlx.core as mx
import numpy as np

from .. import masks
from ..acceptance import greedy_accept, sampling_accept, target_probs
from ..drafter.beam import Drafts, compiled_beam_search, dedup_prefix, pack_beams, sample_beams
from ..errors import UserError
from ..model.forward import forward
from .base import DecodeContext, Step, new_contiguous_cache, prefill

DEFAULT_BEAM_WIDTH = 2
DEFAULT_BEAM_LENGTH = 5


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
    if width < 1 or length < 2:
        raise UserError("redrafter needs --beam-width >= 1 and --beam-length >= 2")
    model, stats = ctx.lm.model, ctx.stats
    embed = model.model.embed_tokens
    greedy = ctx.params.greedy
    temperature, top_p = ctx.params.temperature, ctx.params.top_p

    search = compiled_beam_search(head, embed, width, length) if greedy else None

    def draft(hidden: mx.array, token: mx.array):  # hidden (1, D), token (1,) -> Drafts, owner
        if greedy:
            beams, owner = search(hidden, token)
            return Drafts(beams, None), owner
        drafts = sample_beams(head, embed, hidden, token, width, length, temperature)
        return drafts, dedup_prefix(drafts.beams)

    def own_token(logits: mx.array) -> mx.array:  # (V,) -> () the target's own choice
        if greedy:
            return mx.argmax(logits)
        return mx.random.categorical(mx.log(target_probs(logits, temperature, top_p)))

    timings = {"draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0, "pack_s": 0.0, "sync_s": 0.0}
    per_position = np.zeros(length - 1, dtype=np.int64)  # steps that accepted >= k+1 drafts
    before_dedup = after_dedup = steps = 0

    def mark(name: str, since: float) -> float:
        """Profile mode only: a deliberate extra sync per phase, to attribute time."""
        now = time.perf_counter()
        if profile:
            timings[name] += now - since
        return now

    cache = new_contiguous_cache(ctx)
    prefill(ctx, cache, ctx.prompt[:-1])
    out = forward(model, mx.array(ctx.prompt[-1:])[None], cache, logits_for="last")
    token = own_token(out.logits[0, -1])
    drafts, owner = draft(out.hidden[:, -1], token[None])
    token, beams, owner = _read(token, drafts.beams[0], owner[0])  # host sync: first token + drafts
    stats.forward_passes += 1
    committed = cache.offset
    yield Step([token])
    try:
        while True:
            t0 = time.perf_counter()
            tree = pack_beams(beams, owner)
            n = len(tree.tokens)
            before_dedup += beams.size
            after_dedup += n
            positions = mx.array(tree.depths + committed)[None]  # (1, N)
            mask = masks.prefix_tree_mask(tree.parents, committed)[None, None]  # (1, 1, N, committed + N)
            index = mx.array(tree.index)  # (W, L) packed position of every beam token
            t0 = mark("pack_s", t0)

            out = forward(model, mx.array(tree.tokens)[None], cache, positions=positions, mask=mask)
            beam_logits = out.logits[0][index]  # (W, L, V): unpacked back to beams
            if profile:
                mx.eval(beam_logits)
            t0 = mark("verify_s", t0)

            beams_mx = mx.array(beams)
            if greedy:
                result = greedy_accept(beams_mx, beam_logits)
            else:
                probs = target_probs(beam_logits, temperature, top_p)  # (W, L, V)
                q = _draft_probs_full(drafts.draft_probs[0], head.draft_to_full, probs.shape[-1])
                result = sampling_accept(beams_mx, probs, q)
            last = index.reshape(-1)[result.beam * length + result.num_accepted]  # packed pos of the last accepted token
            if profile:
                mx.eval(result, last)
            t0 = mark("accept_s", t0)

            drafts, next_owner = draft(out.hidden[0, last][None], result.next_token[None])  # next step, lazily
            if profile:
                mx.eval(drafts.beams, next_owner)
            t0 = mark("draft_s", t0)

            # The one host sync of the step: acceptance result + the next step's drafts and owners.
            beam, accepted, token, next_beams, next_owner = _read(
                result.beam, result.num_accepted, result.next_token, drafts.beams[0], next_owner[0])
            mark("sync_s", t0)

            cache.keep_appended(committed, tree.index[beam, : accepted + 1])
            committed = cache.offset
            stats.forward_passes += 1
            steps += 1
            per_position[:accepted] += 1
            new_tokens = [int(t) for t in beams[beam, 1 : accepted + 1]] + [token]
            _report(stats, width, length, steps, per_position, before_dedup, after_dedup, timings, profile)
            beams, owner = next_beams, next_owner
            yield Step(new_tokens, drafted=length - 1, accepted=accepted)
    finally:
        if cache.offset > committed:  # stopped mid-step: drop the unverified tree
            cache.rollback_to(committed)


def _read(*arrays):
    """Evaluate together and bring to the host (the deliberate sync): scalars as int, rest numpy."""
    mx.eval(*arrays)
    return [a.item() if a.ndim == 0 else np.array(a) for a in arrays]


def _draft_probs_full(draft_probs: mx.array, draft_to_full: mx.array, vocab: int) -> mx.array:
    """(W, L-1, K) draft-vocabulary distribution -> (W, L-1, V), zero outside the draft vocabulary."""
    W, steps, _ = draft_probs.shape
    full = mx.zeros((W, steps, vocab), dtype=draft_probs.dtype)
    return full.at[:, :, draft_to_full].add(draft_probs)


def _report(stats, width, length, steps, per_position, before, after, timings, profile) -> None:
    stats.extra.update(
        beam_width=width,
        beam_length=length,
        steps=steps,
        acceptance_per_position=[round(float(c) / steps, 3) for c in per_position],
        tree_tokens_before_dedup=before,
        tree_tokens_after_dedup=after,
        compression=round(1 - after / before, 3) if before else 0.0,
    )
    if profile:
        stats.extra.update({k: round(v, 4) for k, v in timings.items()})
