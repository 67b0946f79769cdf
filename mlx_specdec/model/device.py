"""Where MLX computes: the CPU, or a GPU through Metal (a Mac) or CUDA (Linux with mlx-cuda).

The rules that depend on it (float32 on the CPU, dequantize a quantized model there, attention paths)
ask here, so a backend is recognised in one place.
"""

from __future__ import annotations

import os
import platform

import mlx.core as mx


def cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)  # absent from older MLX builds
    return bool(cuda and cuda.is_available())


def on_cpu() -> bool:
    """MLX computes on the CPU: the default device is the CPU, or no GPU backend is present."""
    return mx.default_device() == mx.cpu or not (mx.metal.is_available() or cuda_available())


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and cuda_available()


def machine() -> dict:
    """What a measured decision depends on besides the model: the device, the CPU it runs on and
    the BLAS that multiplies there (`_blas.py`)."""
    from .._blas import loaded_blas

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {"device": "cpu" if on_cpu() else "gpu", "device_name": str(info.get("device_name", "")),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "system": platform.system(), "blas": loaded_blas if on_cpu() else ""}
