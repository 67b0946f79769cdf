"""Decoding strategies, one module per method, all yielding the same `Step`s."""

from .apar import apar
from .autoregressive import autoregressive
from .base import Event, GenerationParams, GenerationStats, Step, stream_events
from .mlx_lm_baseline import mlx_lm_baseline
from .redrafter import redrafter
from .triforce import triforce

#: method name -> strategy generator function. `ar` is plain decoding; `mlx-lm` the peer baseline.
#: `apar` needs a model with [Fork]/[Child] tokens (an APAR adapter or an official checkpoint).
#: `triforce` is for long prompts: the target over a retrieval cache drafts for the full cache.
STRATEGIES = {
    "ar": autoregressive,
    "mlx-lm": mlx_lm_baseline,
    "redrafter": redrafter,
    "apar": apar,
    "triforce": triforce,
}

__all__ = ["STRATEGIES", "Event", "GenerationParams", "GenerationStats", "Step", "stream_events"]
