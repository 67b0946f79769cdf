"""APAR's two control tokens, and which convention a model uses.

- [Fork]: the model writes it where what follows is detail that can be written in parallel with
  the next paragraph. The thread forks: a child continues after an injected [Child].
- [Child]: injected as the first token of a child thread; never sampled.

Two conventions:

- `project`: our own `[Fork]` / `[Child]`, added to a model's tokenizer and embeddings by an APAR
  adapter trained with `mlx-specdec train-apar` (the adapter's config names them).
- `apar`: the official THUDM/apar-7b / apar-13b checkpoints (Vicuna v1.3 + 2 tokens, vocab 32002),
  whose tokenizer names them `[SplitMask]` (Fork) and `[SplitSop]` (Child).

Ids are never hard-coded: they come from the config's `apar` entry or from the tokenizer's
vocabulary by name, or (an official checkpoint whose tokenizer lost the added tokens) from its
card and config: the two tokens appended after the base vocabulary, Fork first.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, Optional

CONVENTIONS: Dict[str, tuple] = {
    "project": ("[Fork]", "[Child]"),
    "apar": ("[SplitMask]", "[SplitSop]"),
}


@dataclass(frozen=True)
class ControlTokens:
    fork: int
    child: int
    convention: str = "project"

    @property
    def names(self) -> tuple:
        return CONVENTIONS[self.convention]

    @property
    def ids(self) -> tuple:
        return (self.fork, self.child)


def _vocab(tokenizer) -> Dict[str, int]:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return dict(inner.get_vocab())
    except (AttributeError, TypeError):
        return {}


def _by_names(vocab: Dict[str, int], convention: str) -> Optional[ControlTokens]:
    fork, child = CONVENTIONS[convention]
    if fork in vocab and child in vocab:
        return ControlTokens(vocab[fork], vocab[child], convention)
    return None


def _card_says_apar(path: Optional[Path]) -> bool:
    if path is None:
        return False
    card = Path(path) / "README.md"
    try:
        text = card.read_text(errors="replace")[:20000]
    except OSError:
        return False
    return "APAR" in text or "SplitMask" in text


def find_control_tokens(tokenizer, config: Optional[dict] = None,
                        path: Optional[Path] = None) -> Optional[ControlTokens]:
    """The model's control tokens, or None if it has none (it cannot decode with APAR)."""
    config = config or {}
    vocab = _vocab(tokenizer)
    declared = config.get("apar")
    if isinstance(declared, dict):  # an adapter (or a card-derived config) names them
        convention = declared.get("convention", "project")
        fork = declared.get("fork_token", CONVENTIONS.get(convention, ("", ""))[0])
        child = declared.get("child_token", CONVENTIONS.get(convention, ("", ""))[1])
        if fork in vocab and child in vocab:
            return ControlTokens(vocab[fork], vocab[child], convention)
    for convention in ("apar", "project"):
        found = _by_names(vocab, convention)
        if found is not None:
            return found
    # An official checkpoint whose tokenizer files lack the added tokens: its card says APAR and
    # its config's vocabulary is the tokenizer's plus two (Fork then Child appended).
    vocab_size = config.get("vocab_size")
    if vocab and vocab_size == len(vocab) + 2 and _card_says_apar(path):
        return ControlTokens(len(vocab), len(vocab) + 1, "apar")
    return None


def control_tokens_for(lm) -> Optional[ControlTokens]:
    """`find_control_tokens` for a LoadedModel."""
    return find_control_tokens(lm.tokenizer, lm.config, getattr(lm, "path", None))


@lru_cache(maxsize=8)
def newline_token_ids(tokenizer) -> frozenset:
    """Ids of the tokens that are a line break and nothing else but whitespace (where a skeleton
    adapter's child ends, the token unwritten). A token that merges text with the break (".\n")
    is not one: ending there would drop its text, so such a child goes on to the next break or EOS.
    (SmolLM2's vocabulary has 129 tokens with a line break, all of them whitespace.)"""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    size = len(inner) if hasattr(inner, "__len__") else len(_vocab(tokenizer))
    texts = ((i, inner.decode([i])) for i in range(size))
    return frozenset(i for i, text in texts if "\n" in text and not text.strip())
