"""TriForce's bottom level: a drafting source chosen by name (`--bottom`), built for one sequence.

    ngram      prompt lookup (free: no model)
    none       no drafts: the middle level writes one token per forward
    model      a small same-tokenizer draft model over a StreamingLLM cache (`--draft-model`)
    redrafter  the ReDrafter head on the middle level's hidden state

The middle level drafts through it as through any source (`drafting.middle.Bottom`).
"""

from __future__ import annotations

from ..drafting import HeadProposer, ModelProposer, NgramProposer
from ..drafting.base import NoDrafts, Proposer
from ..errors import UserError

DEFAULT_BOTTOM = "ngram"
DEFAULT_DRAFT_SINK = 16  # the draft model's cache: first tokens kept (the attention sink)
DEFAULT_DRAFT_WINDOW = 240  # ... and the most recent tokens kept


def _ngram(ctx, length: int, vocab: int) -> Proposer:
    return NgramProposer(1, length, vocab=vocab)


def _none(ctx, length: int, vocab: int) -> Proposer:
    return NoDrafts()


def _model(ctx, length: int, vocab: int) -> Proposer:
    draft = ctx.resources.get("draft_model")
    if draft is None:
        raise UserError("--bottom model needs a small draft model with the target's tokenizer: "
                        "pass --draft-model PATH")
    options, params = ctx.params.options, ctx.params
    return ModelProposer(draft.model, length, vocab, sink=int(options.get("draft_sink", DEFAULT_DRAFT_SINK)),
                         window=int(options.get("draft_window", DEFAULT_DRAFT_WINDOW)),
                         temperature=params.temperature, top_p=params.top_p)


def _head(ctx, length: int, vocab: int) -> Proposer:
    head = ctx.resources.get("drafter")
    if head is None:
        raise UserError("--bottom redrafter needs a trained draft head for this model (none found)")
    return HeadProposer(head, ctx.lm.model.model.embed_tokens, 1, length, vocab, temperature=ctx.params.temperature)


_FACTORIES = {"ngram": _ngram, "none": _none, "model": _model, "redrafter": _head}
BOTTOMS = tuple(_FACTORIES)  # TriForce's bottom choices


def make_bottom(name: str, ctx, draft_length: int, vocab: int) -> Proposer:
    """The bottom source `name` for this generation, drafting `draft_length` tokens (resources:
    "draft_model", "drafter"); vocab: the width of the target's logits."""
    if name not in _FACTORIES:
        raise UserError(f"--bottom is {', '.join(BOTTOMS)}, not {name!r}")
    return _FACTORIES[name](ctx, draft_length + 1, vocab)
