"""APAR training losses: cross-entropy under the tree mask, and the KL-to-base distillation term.

Shared by the training loop (`train.py`) and the teacher-forced evaluation (`evaluate.py`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..model.forward import forward, lm_head
from .samples import TreeSample, collate
from .tokens import ControlTokens


def set_lora_gate(model: nn.Module, gates: Optional[mx.array]) -> None:
    """Set the per-token gate of a skeleton model before building a forward (no-op otherwise)."""
    gate = getattr(model, "lora_gate", None)
    if gate is not None:
        gate.value = gates


def sequence_loss(model: nn.Module, tokens, positions, mask, rows, cols, targets, teacher=None, soft=None,
                  kl_weight: float = 0.0, reduce: str = "mean"):
    """Per selected position (under the tree mask): cross-entropy with its target, or, where
    `soft` and a teacher is given, kl_weight x KL(teacher || model) over the teacher's vocabulary.

    teacher: (K, V0) log-probabilities of the base model (V0 = base vocabulary, no control tokens,
    so the adapted model also learns not to fork there); soft: (K,) bool."""
    hidden = forward(model, tokens, None, positions=positions, mask=mask, logits_for="none").hidden
    picked = hidden[rows, cols]  # (K, D): only positions with a target reach the vocabulary
    logits = lm_head(model, picked).astype(mx.float32)  # (K, V0 + 2)
    per_token = nn.losses.cross_entropy(logits, targets, reduction="none")  # (K,)
    if teacher is not None:
        per_token = mx.where(soft, kl_weight * kl_from_teacher(teacher, logits), per_token)
    return per_token.mean() if reduce == "mean" else per_token


def kl_from_teacher(teacher: mx.array, logits: mx.array) -> mx.array:
    """(K,) KL(p || q) = sum_v p_v (log p_v - log q_v), p the teacher's (K, V0) log-probs, q the
    model's softmax over (K, V0 + 2) logits: q's control-token mass counts as a miss."""
    log_q = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return (mx.exp(teacher) * (teacher - log_q[:, : teacher.shape[-1]])).sum(axis=-1)


@contextmanager
def lora_disabled(model: nn.Module):
    """The base model for the duration: every LoRA update scaled by 0 (y + 0 * z == y exactly).
    MLX records the scale when the graph is built, so arrays built inside stay the base's."""
    from mlx_lm.tuner.lora import LoRALinear

    layers = [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    scales = [m.scale for m in layers]
    for m in layers:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(layers, scales):
            m.scale = scale


def base_log_probs(model: nn.Module, tokens, positions, mask, rows, cols, base_vocab: int) -> mx.array:
    """(K, base_vocab) log-probabilities of the frozen base model at the selected positions."""
    with lora_disabled(model):
        hidden = forward(model, tokens, None, positions=positions, mask=mask, logits_for="none").hidden
        logits = lm_head(model, hidden[rows, cols])[:, :base_vocab].astype(mx.float32)
        teacher = mx.stop_gradient(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(teacher)
    return teacher


def soft_positions(tokens, rows, cols, targets, control: ControlTokens, eos_ids: Sequence[int]) -> mx.array:
    """(K,) True where the target is text the base model should write: not a fork or an end, and
    not the first token after [Fork] (the parent's next sibling) or [Child] (the child's start)."""
    fed = tokens[rows, cols]
    hard = (targets == control.fork) | (fed == control.fork) | (fed == control.child)
    for eos in eos_ids:
        hard = hard | (targets == eos)
    return mx.logical_not(hard)


def teacher_log_probs(model, batch: Sequence[TreeSample], arrays, control: ControlTokens) -> mx.array:
    """The base model's (K, V0) log-probs for the batch's targets, each thread's path read as
    plain text: [Fork]/[Child] hidden and taking no position. (Shown the control tokens, which it
    never learned, the base model writes a child's detail about the wrong item.)"""
    tokens, _, _, rows, cols, _ = arrays
    _, positions, mask, *_ = collate(batch, hide_tokens=(control.fork, control.child))
    return base_log_probs(model, tokens, positions, mask, rows, cols, min(control.fork, control.child))
