"""The drafting sources a method can name: name -> how to build it, and one line of help.

`redrafter --sources lookup,head` asks its sources in that order for each row's drafts: the
host-side ones first (the first that offers a chain drafts the row: `first_offer.py`), then the
ReDrafter head, which must come last and drafts every row the others leave.

Adding a source: write it in its own module (a class with the members of `base.Proposer`;
`ProposerDefaults` and `HostSideDefaults` give the ones it has no use for), add one entry to
SOURCES below, and test it. Nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Sequence, Union

from .base import Proposer
from .head_source import HeadProposer
from .lookup import PromptLookup
from .recent import RecentToken

FALLBACK = "head"  # the source that drafts every row the others leave: always last
FALLBACKS = (FALLBACK, "model")  # ... the head, or a small draft model in its place


@dataclass(frozen=True)
class SourceSettings:
    """What a source may be built from; each factory takes what it needs."""

    vocab: int  # the target's vocabulary size
    drafts: int = 4  # tokens a host-side source drafts per step (redrafter's `lookup`)
    head: Any = None  # the trained ReDrafter head (redrafter_head.model.DrafterHead)
    embed: Any = None  # the target's token embedding (the head embeds its drafts with it)
    width: int = 1  # the head's beams per row
    length: int = 2  # the head's beam length, the target's own token first
    temperature: float = 0.0  # > 0: the head samples its drafts (exact acceptance needs their q)
    stepwise: bool = False  # the head drafts a greedy chain one depth at a time
    runners_up: int = 0  # ... offering its next choices beside the chain's drafts
    runner_depths: int = 1  # ... at this many of the chain's first drafts
    draft_model: Any = None  # a small same-tokenizer model (model.loader.LoadedModel), `--draft-model`


class Source(NamedTuple):
    build: Callable[[SourceSettings], Proposer]
    help: str


def _head(s: SourceSettings) -> Proposer:
    return HeadProposer(s.head, s.embed, s.width, s.length, s.vocab, temperature=s.temperature, stepwise=s.stepwise,
                        runners_up=s.runners_up, runner_depths=s.runner_depths)


def _model(s: SourceSettings) -> Proposer:
    from .draft_model import ModelProposer

    return ModelProposer(s.draft_model.model, s.length, s.vocab)


SOURCES: Dict[str, Source] = {
    "lookup": Source(lambda s: PromptLookup(s.drafts, s.vocab),
                     "prompt lookup: what followed the latest earlier occurrence of the text's last 2-4 tokens"),
    "recent": Source(lambda s: RecentToken(s.drafts, s.vocab),
                     "what followed the newest earlier occurrence of the own token alone (a 1-gram lookup)"),
    FALLBACK: Source(_head, "the ReDrafter head on the target's hidden state (last: it drafts the rows left)"),
    "model": Source(_model, "a small same-tokenizer draft model (--draft-model), its greedy chain, in the head's place"),
}


def source_names(value: Union[str, Sequence[str]]) -> List[str]:
    """"lookup,head" (or a list of names) -> the names, checked: known, each once, the head last."""
    names = [n.strip() for n in value.split(",") if n.strip()] if isinstance(value, str) else list(value)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ValueError(f"unknown drafting source {unknown[0]!r}: choose from {', '.join(SOURCES)}")
    if len(set(names)) != len(names) or not names or names[-1] not in FALLBACKS or \
            any(n in FALLBACKS for n in names[:-1]):
        raise ValueError(f"the drafting sources are distinct names ending with {' or '.join(map(repr, FALLBACKS))}, "
                         f"not {','.join(names)!r}")
    return names
