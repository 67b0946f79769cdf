"""ReDrafter (Cheng et al. 2024): an RNN draft head on the target's last hidden state drafts,
and one forward verifies the drafts as a tree.

One step, entered with the cache holding every committed token except the target's own latest
token x, and with the hidden state h that produced x (per batch row; `redrafter_step.py`):

    plan    how deep to verify: the leading drafts whose confidence, times the row's running
            trust in their source (drafting/calibration.py), clears the cutoff; of those, the
            depth with the most expected tokens per unit of verify cost at this context
            (drafting/verify_cost.py), the head's runners-up competing for the same query
            tokens (drafting/runners_up.py); none kept = a plain step   [host]
    pack    dedup shared prefixes -> N distinct tokens, their depths and tree mask   [host, tiny]
    verify  one forward of the N tokens at positions length + depth under the tree mask
    accept  the longest run the target agrees with -> n, next token: greedy, the target's argmax at
            every packed node; sampling, the target's own sample at every packed node (the tree
            is the greedy one, fixed before the draws: every emitted token is drawn from the
            target given the emitted prefix, so the output is exactly the target's), or, with
            `sampled_drafts`, rejection sampling over chains the head sampled
    draft   the next step's drafts: per row, the first host-side source that offers a chain
            after the next token (prompt lookup, drafting/lookup.py), else the head's, built
            lazily from the accepted path's hidden state (drafting/first_offer.py)
    commit  the cache keeps the n+1 accepted tokens (only the offset moves when they already
            lie first, as a chain's always do), drops the rest; each source's trust learns

The sources are named in `sources` (default "lookup,head"; the registry is drafting/sources.py):
the head comes last and drafts every row the others leave. A model with no draft head still
speculates: the host-side sources draft, and a row none of them drafts takes a plain step
(`drafting.base.NoHead`; the stats' `source_steps` call it "none"), or, given one, a small
same-tokenizer draft model drafts its greedy chain in the head's place (the "model" source).

Host syncs: with no host-side source, one a step, reading the acceptance and the next drafts
together. With one, the acceptance is read first (a lookup needs the token on the host) and the
head's drafts in a second sync, only where a row needs them. A greedy chain (the default) reads
its first draft there and each deeper one in a sync of its own, made only while the cutoff would
keep the chain that deep (`HeadProposer` stepwise: the same trees, fewer projections). Before
the first step the first tokens are read on their own and yielded; all drafting is decoding time.

A batch of prompts runs as rows of one cache. Rows accept different numbers of tokens, so the
cache is ragged: every row is packed from the same physical offset and a row that kept fewer
tokens leaves holes, hidden from later queries by a per-row `valid` mask. One row has no holes.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from ..drafting.base import NoHead
from ..drafting.sources import SOURCES, SourceSettings, source_names
from ..errors import UserError
from .base import DecodeContext, Step
from ..model.device import on_cpu
from .redrafter_device import DeviceLoop
from .redrafter_step import RedrafterLoop, Settings

# What each default does; what was measured and chosen is in docs/decisions.md.
DEFAULT_BEAM_WIDTH = 1  # beams (W) the head drafts per step
DEFAULT_BEAM_LENGTH = 6  # tokens per beam (L): the target's own token and up to L-1 drafts
DEFAULT_DRAFT_CUTOFF = 0.1  # verify a draft only where its calibrated confidence is at least this
DEFAULT_DRAFT_TRUST = True  # calibrate each source's confidence by what it has earned in this answer
DEFAULT_LOOKUP = 4  # tokens a host-side source (prompt lookup) drafts per step; 0: the head alone
DEFAULT_SOURCES = "lookup,head"  # drafting sources, asked in this order per row; the head, last, drafts the rest
DEFAULT_EAGER_DRAFTS = False  # draft every depth in one graph, instead of only as deep as a step verifies
DEFAULT_RUNNERS_UP = 2  # the head's next choices per chain draft, verified beside it where they pay
DEFAULT_RUNNERS_UP_DEPTHS = 2  # ... beside the chain's first this many drafts
DEFAULT_RUNNERS_COMPETE = True  # the chain's drafts and the runners-up compete for the verify's tokens
DEFAULT_HEAD_BESIDE_LOOKUP = True  # ... and the head's first draft beside a lookup's, where they differ
DEFAULT_DEEPEN_REACH = 0.25  # draft a chain deeper only while it is at least this likely to be accepted whole
DEFAULT_PROMPT_DRAFT = False  # draft from the prompt: the first forward verifies drafts too
DEFAULT_VERIFY_COST = True  # verify the depth worth its cost at this context ("margin": the answer's rate)
DEFAULT_SAMPLED_DRAFTS = False  # sampling: the head samples its chains (rejection sampling), not its likeliest tree
DEFAULT_STEP = "auto"  # the device step (redrafter_device.py) on a GPU, the host-read step on a CPU


NO_HEAD = "none"  # the fallback's name in the stats where the model has no draft head


def redrafter(ctx: DecodeContext) -> Iterator[Step]:
    loop = build_loop(ctx)
    yield from loop.start()
    try:
        while loop.rows:
            yield from loop.step()
    finally:
        loop.close()


def build_loop(ctx: DecodeContext, cls=None) -> RedrafterLoop:
    """The loop for ctx's settings, its drafting sources built (`cls`: the loop's class; None:
    the device step where the settings ask for it and it applies, else the host-read one)."""
    s, names, lookup = settings(ctx)
    if cls is None:
        cls = DeviceLoop if device_step(ctx, s, names) else RedrafterLoop
    head, draft_model = ctx.resources.get("drafter"), ctx.resources.get("draft_model")
    if names[-1] == "head" and head is None and draft_model is not None:
        names[-1] = "model"  # no head for this model: the draft model drafts in its place
    if names[-1] == "model":
        if draft_model is None:
            raise UserError("redrafter: the 'model' source needs a draft model (--draft-model)")
        if len(ctx.prompts) > 1:
            raise UserError("redrafter with a draft model decodes one request at a time")
    if names[-1] != "head" or head is None:  # no hidden-state head: no runners-up, no sampled chains
        s = dataclasses.replace(s, sampled_drafts=False, runners_up=0, stepwise=False)
    if names[-1] == "head" and head is None:  # nothing drafts on the device: the other rows step plainly
        names[-1] = NO_HEAD
    vocab = int(ctx.lm.model.args.vocab_size)
    built = SourceSettings(vocab=vocab, drafts=lookup, head=head,
                           embed=ctx.lm.model.model.embed_tokens, width=s.width, length=s.length,
                           temperature=0.0 if ctx.params.greedy or not s.sampled_drafts else ctx.params.temperature,
                           stepwise=s.stepwise, runners_up=s.runners_up, runner_depths=s.runner_depths,
                           draft_model=draft_model)
    sources = {name: NoHead() if name == NO_HEAD else SOURCES[name].build(built) for name in names}
    for name in names[:-1]:
        if not sources[name].host_side:
            raise UserError(f"redrafter: {name!r} drafts on the device; only the head, last, may")
    return cls(ctx, s, sources, vocab)


def device_step(ctx: DecodeContext, s: Settings, names) -> bool:
    """Whether a batch runs the device step: asked for (auto: on a GPU), and drafted by what it
    reads in one graph (not sampled chains, not a draft model that drafts after the text)."""
    asked = ctx.params.options.get("step", DEFAULT_STEP)
    wanted = asked == "device" or (asked == "auto" and not on_cpu())
    return wanted and not s.sampled_drafts and names[-1] != "model"


def settings(ctx: DecodeContext):
    """The method's settings from ctx.params.options, checked -> (Settings, the sources' names in
    the order asked, the tokens a host-side source drafts)."""
    options = ctx.params.options
    width = int(options.get("beam_width", DEFAULT_BEAM_WIDTH))
    length = int(options.get("beam_length", DEFAULT_BEAM_LENGTH))
    cutoff = float(options.get("draft_cutoff", DEFAULT_DRAFT_CUTOFF))
    lookup = int(options.get("lookup", DEFAULT_LOOKUP))
    if width < 1 or length < 2:
        raise UserError("redrafter needs --beam-width >= 1 and --beam-length >= 2")
    if not 0.0 <= cutoff <= 1.0:
        raise UserError("redrafter needs --draft-cutoff between 0 and 1")
    try:
        names = source_names(options.get("sources", DEFAULT_SOURCES))
    except ValueError as error:
        raise UserError(f"redrafter: {error}") from None
    if lookup <= 0:
        names = names[-1:]  # no host-side drafts: the head alone
    # This machine's verify-cost table (`mlx-specdec calibrate`), the shipped one on a CPU, or none.
    # A cutoff of 0 asks for every draft: no cost judges them either.
    cost_table = ctx.resources.get("verify_costs")
    cost_rule = options.get("verify_cost", DEFAULT_VERIFY_COST)  # True, False or "margin"
    cost_aware = bool(cost_rule) and cost_table is not None and cutoff > 0
    margin = cost_aware and cost_rule == "margin"
    # Lazy (the default): greedy chains are drafted one depth at a time, only as deep as the cutoff
    # lets a step verify, and the head's drafts are read only where no host-side source offered
    # one. Eager, or with no cutoff: every depth in one graph, read with the acceptance.
    eager = bool(options.get("eager_drafts", DEFAULT_EAGER_DRAFTS))
    s = Settings(
        width=width, length=length, cutoff=cutoff,
        use_trust=bool(options.get("draft_trust", DEFAULT_DRAFT_TRUST)),
        cost_table=cost_table, cost_aware=cost_aware, margin=margin, eager=eager,
        stepwise=bool(options.get("stepwise_draft", not eager)) and cutoff > 0,
        runners_up=int(options.get("runners_up", DEFAULT_RUNNERS_UP)),
        runner_depths=int(options.get("runners_up_depths", DEFAULT_RUNNERS_UP_DEPTHS)),
        deepen_reach=float(options.get("deepen_reach", DEFAULT_DEEPEN_REACH)),
        compete=bool(options.get("runners_compete", DEFAULT_RUNNERS_COMPETE)) and not margin,
        beside_host=bool(options.get("head_beside_lookup", DEFAULT_HEAD_BESIDE_LOOKUP)) and len(names) > 1,
        prompt_draft=bool(options.get("prompt_draft", DEFAULT_PROMPT_DRAFT)),
        sampled_drafts=bool(options.get("sampled_drafts", DEFAULT_SAMPLED_DRAFTS)) and not ctx.params.greedy,
        profile=bool(options.get("profile", False)))
    return s, names, lookup
