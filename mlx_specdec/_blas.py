"""Load the system OpenBLAS before MLX on Linux.

The Linux `mlx-cpu` wheel links a reference BLAS. Loading OpenBLAS first with RTLD_GLOBAL makes
its `cblas_sgemm` win symbol resolution: a 64x576x1536 float32 matmul went from 36 ms to 2.7 ms
here and SmolLM2-135M prefill got 11x faster (../shared/design.md). This must run before the
first `import mlx.core`, so `mlx_specdec/__init__.py` imports it first.
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = ("libopenblas.so.0", "libopenblasp-r0.so", "libopenblas.so")

#: What was loaded, for the environment row of every benchmark.
loaded_blas: str = "none"


def preload_openblas() -> str:
    global loaded_blas
    if sys.platform != "linux" or os.environ.get("MLX_SPECDEC_NO_OPENBLAS"):
        loaded_blas = "Accelerate" if sys.platform == "darwin" else "reference"
        return loaded_blas
    if "mlx.core" in sys.modules:
        # Too late to win symbol resolution; say so honestly in the environment row.
        loaded_blas = "reference (mlx imported before mlx_specdec)"
        return loaded_blas
    for name in CANDIDATES:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        loaded_blas = f"OpenBLAS ({name})"
        return loaded_blas
    loaded_blas = "reference (install libopenblas0-pthread for ~10x faster CPU matmuls)"
    return loaded_blas


preload_openblas()
