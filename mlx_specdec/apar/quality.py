"""APAR's quality guard: how likely the original model finds an answer.

APAR changes the model (an adapter) and the order text is written in (threads that do not see
their siblings), so its answers are not the original model's. The guard scores a restored answer
by the mean per-token negative log-likelihood of the answer under the original, un-tuned model,
teacher-forced after the same prompt. The original model's own greedy
answer is the reference (a low NLL by construction, since greedy picks likely tokens); the
restored APAR answer should stay within 10% of it.

The answer text is re-encoded before scoring, so both answers are scored in the tokenizer's own
segmentation (a restored tree's token ids can split a word at a thread boundary differently).
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx

from ..model.forward import forward


def answer_nll(lm, prompt_ids: Sequence[int], answer_text: str) -> float:
    """Mean NLL (nats per token) of `answer_text` after `prompt_ids` under `lm`; NaN if empty."""
    answer = list(lm.tokenizer.encode(answer_text, add_special_tokens=False))
    if not answer:
        return math.nan
    ids = list(prompt_ids) + answer
    window = lm.context_length
    if len(ids) > window:
        ids = ids[:window]
        answer = ids[len(prompt_ids):]
        if not answer:
            return math.nan
    first = len(prompt_ids) - 1  # the position whose logits predict answer[0]
    predictors = mx.arange(first, len(ids) - 1)  # (T,)
    out = forward(lm.model, mx.array(ids)[None], None, logits_for=predictors)
    logits = out.logits[0].astype(mx.float32)  # (T, V)
    targets = mx.array(answer)  # (T,)
    nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return float(nll.mean().item())  # host sync: one number per answer (scoring, not decoding)
