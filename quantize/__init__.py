"""Quantize-and-run: float16 -> 4-bit with mlx-lm, then run both and compare."""
