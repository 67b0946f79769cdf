"""The draft vocabulary: the K answer tokens a head predicts, and what K costs and covers.

A head scores only K of the LLM's ~49K tokens (the most frequent in the distillation answers, EOS
always in): the logits cost falls with K while the share of answer tokens it can express falls too.
`measure_draft_vocab` reports both so that K is chosen by measurement (train-drafter prints it).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from .data import Sequences
from .model import DrafterConfig, DrafterHead, llm_shapes


def draft_vocabulary(tokens: np.ndarray, k: int, vocab_size: int, always: Optional[List[int]] = None) -> np.ndarray:
    """The k most frequent token ids of `tokens` (ties by id), plus `always` ids (e.g. EOS)."""
    counts = np.bincount(tokens.astype(np.int64), minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id
    chosen = list(order[:k])
    for t in always or []:
        if t not in chosen:
            chosen[-1 - (always or []).index(t)] = t
    return np.array(sorted(set(int(c) for c in chosen)), dtype=np.int32)


def coverage(tokens: np.ndarray, draft_to_full: np.ndarray) -> float:
    return float(np.isin(tokens, draft_to_full).mean())


def time_logits(head_full: DrafterHead, head_k: DrafterHead, batch: int = 4, repeats: int = 50) -> Dict[str, float]:
    """Milliseconds per `logits` call (batch rows) for a full-vocabulary head and a K head."""
    out = {}
    for name, h in (("full", head_full), ("k", head_k)):
        E, D = h.config.embed_size, h.config.llm_hidden_size
        s, hid = mx.random.normal((batch, E)), mx.random.normal((batch, D))
        for _ in range(5):
            mx.eval(h.logits(s, hid))
        t = time.perf_counter()
        for _ in range(repeats):
            mx.eval(h.logits(s, hid))
        out[name] = (time.perf_counter() - t) / repeats * 1000
    return out


def measure_draft_vocab(lm, train: Sequences, valid: Sequences, ks=(1024, 2048, 4096, 8192),
                        batch: int = 4) -> Dict[str, object]:
    """Coverage of the held-out answers' tokens and `logits` time (batch rows) per draft-vocab K."""
    hidden_size, embed_size, vocab = llm_shapes(lm)

    def head_for(k: int) -> DrafterHead:
        cfg = DrafterConfig(hidden_size, embed_size, vocab, k)
        h = DrafterHead(cfg, draft_vocabulary(train.tokens, k, vocab) if k < vocab else None)
        mx.eval(h.parameters())
        return h

    full = head_for(vocab)
    rows = {}
    for k in ks:
        d2f = draft_vocabulary(train.tokens, k, vocab, always=sorted(lm.eos_token_ids))
        times = time_logits(full, head_for(k), batch=batch)
        rows[str(k)] = {"valid_coverage": round(coverage(valid.tokens, d2f), 4),
                        "train_coverage": round(coverage(train.tokens, d2f), 4),
                        "logits_ms": round(times["k"], 3), "full_logits_ms": round(times["full"], 3)}
    return {"batch": batch, "vocab": vocab, "distinct_train_tokens": int(len(np.unique(train.tokens))),
            "by_k": rows}
