"""Model loading (mlx-lm weights, GGUF conversion, the embedded default) and the forward pass."""

from .forward import ForwardOutput, forward, lm_head, rope_at

__all__ = ["ForwardOutput", "forward", "lm_head", "rope_at"]
