"""The bench's prompts: FastChat question files or plain text, the long-document sets by size
(`--context-length`), prompt ids, and the window check that refuses a prompt rather than cut it."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from .engine import Engine
from .errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO_ROOT / "benchmarks" / "prompts.jsonl"
LONG_PROMPTS = REPO_ROOT / "benchmarks" / "long_prompts.jsonl"  # built by benchmarks/long_prompts.py


@dataclass
class Prompt:
    id: str
    category: str
    text: str
    shape: str = "-"  # the answer's expected shape: list, paragraphs, code, math (our prompt files)
    context: str = "-"  # long_prompts.jsonl: the size set (2k, 4k, 6k) and its measured tokens
    tokens: Optional[int] = None
    expected: Optional[str] = None  # a needle prompt's pass key: the answer should contain it


def load_prompts(path: Optional[Path], limit: Optional[int] = None,
                 categories: Optional[List[str]] = None, shapes: Optional[List[str]] = None,
                 context: Optional[str] = None, ids: Optional[List[str]] = None) -> List[Prompt]:
    """FastChat question files (JSON lines with question_id, category, turns) or plain text.
    `context` (2k, 4k, 6k, all, or a number of tokens) keeps one size set of a long-prompt file
    (default: benchmarks/long_prompts.jsonl); then ids (prompt ids, in the file's order), then
    categories/shapes, then limit."""
    path = Path(path) if path else (LONG_PROMPTS if context else DEFAULT_PROMPTS)
    if not path.exists():
        raise UserError(f"prompt file {path} does not exist")
    prompts: List[Prompt] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                record = json.loads(line)
                turns = record.get("turns") or [record.get("prompt") or record.get("text")]
                prompts.append(Prompt(str(record.get("question_id", record.get("id", number))),
                                      record.get("category", "-"), str(turns[0]), record.get("shape", "-"),
                                      str(record.get("context", "-")), record.get("tokens"),
                                      None if record.get("expected") is None else str(record["expected"])))
            except (json.JSONDecodeError, TypeError, IndexError) as exc:
                raise UserError(f"{path}:{number}: not a FastChat question line ({exc})") from None
        else:
            prompts.append(Prompt(str(number), "-", line))
    if context:
        prompts = select_context(prompts, context, path)
    if ids:
        unknown = sorted(set(ids) - {p.id for p in prompts})
        if unknown:
            raise UserError(f"no prompt with id {', '.join(unknown)} in {path}")
        prompts = [p for p in prompts if p.id in ids]
    if categories or shapes:  # a prompt is kept if its category or its shape is asked for
        prompts = [p for p in prompts if p.category in (categories or []) or p.shape in (shapes or [])]
    if limit:
        prompts = prompts[:limit]
    if not prompts:
        raise UserError(f"no prompts selected from {path}")
    return prompts


def select_context(prompts: List[Prompt], size: str, path: Path) -> List[Prompt]:
    """The prompts of one size set: its name (2k), `all`, or a number of tokens (the set whose mean
    measured `tokens` is nearest)."""
    sets: Dict[str, List[Prompt]] = {}
    for prompt in prompts:
        if prompt.context != "-":
            sets.setdefault(prompt.context, []).append(prompt)
    names = ", ".join(sets) or "none"
    wanted = size.strip().lower()
    if not sets:
        raise UserError(f"--context-length: {path} has no size sets (no 'context' field); "
                        f"use benchmarks/long_prompts.jsonl")
    if wanted == "all":
        return [p for p in prompts if p.context != "-"]
    for name, members in sets.items():
        if name.lower() == wanted:
            return members
    if wanted.isdigit() and int(wanted) > 0:
        def mean_tokens(name: str) -> float:
            counted = [p.tokens for p in sets[name] if p.tokens]
            return statistics.fmean(counted) if counted else float("inf")
        return sets[min(sets, key=lambda name: abs(mean_tokens(name) - int(wanted)))]
    raise UserError(f"unknown --context-length {size!r}: {path.name} has {names} "
                    f"(or give all, or a number of tokens such as 4096)")


def check_window(engine: Engine, prompts: List[Prompt], max_tokens: int) -> Dict[str, int]:
    """Each prompt's tokens (as the engine encodes it); refuses, naming the first, any prompt whose
    answer would not fit the model's window: the bench never cuts a prompt or an answer."""
    window, counts = engine.lm.context_length, {}
    for prompt in prompts:
        counts[prompt.id] = len(engine.lm.encode_prompt(prompt.text))
    over = [p.id for p in prompts if counts[p.id] + max_tokens > window]
    if over:
        more = f" (and {len(over) - 1} more)" if len(over) > 1 else ""
        n = counts[over[0]]
        raise UserError(f"prompt {over[0]}{more} has {n} tokens + --max-tokens {max_tokens} = "
                        f"{n + max_tokens}, past the context window of {engine.lm.name} ({window} tokens); "
                        f"lower --max-tokens or pick a smaller --context-length")
    return counts
