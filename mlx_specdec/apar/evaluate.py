"""Teacher-forced evaluation of an APAR adapter on held-out samples: loss, [Fork] recall and
precision, forks on unstructured answers, and (with EOS ids) how close the text stays to the base."""

from __future__ import annotations

from typing import Dict, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..model.forward import forward, lm_head
from .losses import kl_from_teacher, set_lora_gate, soft_positions, teacher_log_probs
from .samples import TreeSample, collate, lora_gates, make_batches
from .tokens import ControlTokens


def evaluate(model: nn.Module, samples: Sequence[TreeSample], control: ControlTokens,
             tokens_per_batch: int = 2048, eos_ids: Sequence[int] = ()) -> Dict[str, object]:
    """Teacher-forced: loss, and how the model's argmax treats [Fork] at true and false spots.
    With eos_ids, also how close the text stays to the base model (LoRA off) at the text
    positions (`soft_positions`): argmax agreement and mean KL(base || adapted)."""
    rng = np.random.default_rng(0)
    losses, counts = [], 0
    true_forks = hit = predicted = correct = 0
    negative_with_fork = negatives = 0
    agree = soft_count = 0
    kl_sum = 0.0
    for batch_idx in make_batches(samples, range(len(samples)), tokens_per_batch, rng):
        batch = [samples[i] for i in batch_idx]
        arrays = collate(batch)
        tokens, positions, mask, rows, cols, targets = arrays
        set_lora_gate(model, lora_gates(batch, tokens.shape[1]))
        hidden = forward(model, tokens, None, positions=positions, mask=mask, logits_for="none").hidden
        logits = lm_head(model, hidden[rows, cols]).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, targets, reduction="none")
        guess = mx.argmax(logits, axis=-1)
        if eos_ids:
            teacher = teacher_log_probs(model, batch, arrays, control)
            soft = np.array(soft_positions(tokens, rows, cols, targets, control, eos_ids))
            kl = np.array(kl_from_teacher(teacher, logits))
            same = np.array(mx.argmax(teacher, axis=-1) == guess)
            agree += int(same[soft].sum())
            soft_count += int(soft.sum())
            kl_sum += float(kl[soft].sum())
        ce, guess, t, r = (np.array(a) for a in (ce, guess, targets, rows))
        losses.append(float(ce.sum()))
        counts += len(ce)
        true_forks += int((t == control.fork).sum())
        hit += int(((t == control.fork) & (guess == control.fork)).sum())
        predicted += int((guess == control.fork).sum())
        correct += int(((guess == control.fork) & (t == control.fork)).sum())
        for b, s in enumerate(batch):
            if s.kind == "unstructured":
                negatives += 1
                negative_with_fork += int(((r == b) & (guess == control.fork)).any())
    report = {
        "samples": len(samples), "loss": round(sum(losses) / max(counts, 1), 4),
        "fork_recall": round(hit / true_forks, 4) if true_forks else None,
        "fork_precision": round(correct / predicted, 4) if predicted else None,
        "true_forks": true_forks,
        "negatives_with_a_fork": f"{negative_with_fork}/{negatives}",
    }
    if eos_ids:
        report["base_argmax_agreement"] = round(agree / max(soft_count, 1), 4)
        report["base_kl"] = round(kl_sum / max(soft_count, 1), 4)
    return report
