"""Teacher forcing over the distillation data: the windows a step trains on, the loss, and the
held-out measure (top-1 per draft position) every head is chosen by. Training is redrafter_head/train.py."""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .data import Sequences
from .model import DrafterHead, llm_shapes


class Windows:
    """Teacher-forcing windows over one split: for position i the tokens i..i+T and validity."""

    def __init__(self, seqs: Sequences, draft_length: int):
        self.seqs, self.T = seqs, draft_length
        n = len(seqs.tokens)
        ends = np.zeros(n, np.int64)
        for a, b in zip(seqs.offsets[:-1], seqs.offsets[1:]):
            ends[a:b] = b
        self.ends = ends
        # positions with at least one target inside the same answer
        self.positions = np.nonzero(np.arange(n) + 1 < ends)[0]

    def __len__(self) -> int:
        return len(self.positions)

    def batch(self, pos: np.ndarray):
        T = self.T
        idx = pos[:, None] + np.arange(T + 1)[None, :]  # (B, T+1)
        valid = idx < self.ends[pos][:, None]
        toks = self.seqs.tokens[np.minimum(idx, len(self.seqs.tokens) - 1)]
        toks = np.where(valid, toks, 0).astype(np.int32)
        hidden = self.seqs.hidden[pos]
        # the LLM's hidden states that produced the targets tokens[i+1..i+T] (feature targets)
        following = self.seqs.hidden[np.minimum(idx[:, 1:], len(self.seqs.tokens) - 1)]  # (B, T, D)
        return (mx.array(toks), mx.array(valid), mx.array(hidden.astype(np.float32)),
                mx.array(following.astype(np.float32)))


def unroll_states(head: DrafterHead, embeddings: mx.array) -> mx.array:
    """Teacher-forced RNN states. embeddings (B, T, E) of tokens i..i+T-1 -> states (B, T, E)."""
    s = head.initial_state(embeddings[:, 0])
    states = [s]
    for k in range(1, embeddings.shape[1]):
        s = head.next_state(s, embeddings[:, k])
        states.append(s)
    return mx.stack(states, axis=1)


def unroll(head: DrafterHead, embeddings: mx.array, hidden: mx.array) -> mx.array:
    """Teacher-forced draft logits. embeddings (B, T, E) of tokens i..i+T-1 -> (B, T, K)."""
    return head.logits(unroll_states(head, embeddings), hidden[:, None, :])


def loss_fn(head: DrafterHead, embed_table: mx.array, toks: mx.array, valid: mx.array, hidden: mx.array,
            following: mx.array, feature_weight: float = 0.0, teacher_rows: Optional[mx.array] = None,
            soft_weight: float = 0.0):
    """Mean CE over (position, draft step) pairs whose target is in the draft vocabulary, plus
    (output="llm_head") the smooth-L1 distance of the predicted to the real next hidden states.
    soft_weight > 0 (needs teacher_rows (K, D), the LLM's output rows of the draft vocabulary):
    that much of the token loss is the CE against the LLM's own distribution over the draft
    vocabulary, softmax(following @ teacher_rows.T), at every target inside the answer."""
    T = toks.shape[1] - 1
    states = unroll_states(head, embed_table[toks[:, :T]])  # (B, T, E)
    target = head.full_to_draft[toks[:, 1:]]  # (B, T), -1 outside the draft vocabulary
    in_answer = valid[:, 1:]
    mask = in_answer & (target >= 0)
    if head.config.output == "llm_head":
        predicted = head.predict_hidden(states, hidden[:, None, :])  # (B, T, D)
        logits = predicted @ head._output_rows.T
    else:
        logits = head.logits(states, hidden[:, None, :])  # (B, T, K)
    ce = nn.losses.cross_entropy(logits, mx.maximum(target, 0), reduction="none")  # (B, T)
    loss = (ce * mask).sum() / mx.maximum(mask.sum(), 1)
    if soft_weight:
        teacher = mx.stop_gradient(mx.softmax(following @ teacher_rows.T, axis=-1))  # (B, T, K)
        soft = -(teacher * (logits - mx.logsumexp(logits, axis=-1, keepdims=True))).sum(axis=-1)  # (B, T)
        soft = (soft * in_answer).sum() / mx.maximum(in_answer.sum(), 1)
        loss = (1.0 - soft_weight) * loss + soft_weight * soft
    if head.config.output == "llm_head" and feature_weight:
        distance = nn.losses.smooth_l1_loss(predicted, following, reduction="none").mean(axis=-1)  # (B, T)
        loss = loss + feature_weight * (distance * in_answer).sum() / mx.maximum(in_answer.sum(), 1)
    return loss


def llm_embedding_table(lm) -> mx.array:
    """The LLM's token embeddings (V, E) as float32 (dequantized if needed); frozen."""
    embed = lm.model.model.embed_tokens
    V = llm_shapes(lm)[2]
    table = embed(mx.arange(V)).astype(mx.float32)
    mx.eval(table)
    return table


def evaluate_head(head: DrafterHead, lm, seqs: Sequences, batch_size: int = 512,
                  embed_table: Optional[mx.array] = None) -> Dict[str, object]:
    """Teacher-forced top-1 accuracy per draft position on held-out answers, and chain length.

    acc[k]: P(draft token k == the LLM's token) over windows with a k-th target.
    chain (exact, teacher forced): 1 + mean number of leading correct draft tokens, over
    windows with all T targets; product estimate: 1 + sum_k prod_{j<=k} acc[j].
    """
    T = head.config.draft_length
    windows = Windows(seqs, T)
    table = embed_table if embed_table is not None else llm_embedding_table(lm)
    d2f = head.draft_to_full
    correct = np.zeros(T)
    count = np.zeros(T)
    top4 = np.zeros(T)
    leading = []
    for start in range(0, len(windows), batch_size):
        pos = windows.positions[start:start + batch_size]
        toks, valid, hidden, _ = windows.batch(pos)
        logits = unroll(head, table[toks[:, :T]], hidden)  # (B, T, K)
        pred = d2f[mx.argmax(logits, axis=-1)]  # (B, T) full ids
        top = d2f[mx.argpartition(-logits, 4, axis=-1)[..., :4]]  # (B, T, 4)
        tgt = toks[:, 1:]
        ok = np.array(pred == tgt)
        ok4 = np.array((top == tgt[..., None]).any(axis=-1))
        v = np.array(valid[:, 1:])
        correct += (ok & v).sum(0)
        top4 += (ok4 & v).sum(0)
        count += v.sum(0)
        full = v.all(axis=1)
        lead = np.cumprod(ok, axis=1).sum(axis=1)
        leading += list(lead[full])
    acc = correct / np.maximum(count, 1)
    chain_product = 1 + float(np.sum(np.cumprod(acc)))
    return {
        "windows": int(len(windows)),
        "acc": [round(float(a), 4) for a in acc],
        "top4": [round(float(a), 4) for a in top4 / np.maximum(count, 1)],
        "chain_tokens_per_step_exact": round(1 + float(np.mean(leading)) if leading else 1.0, 4),
        "chain_tokens_per_step_product": round(chain_product, 4),
    }
