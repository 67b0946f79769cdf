"""Load the system OpenBLAS before MLX on Linux, with a small-row GEMM in front of it.

The Linux `mlx-cpu` wheel links a reference BLAS. Loading OpenBLAS first with RTLD_GLOBAL makes
its `cblas_sgemm` win symbol resolution, and float32 matmuls (prefill above all) get an order of
magnitude faster. This must run before the first `import mlx.core`, so `mlx_specdec/__init__.py`
imports it first.

A decoding step multiplies 1-8 rows by each weight matrix, and OpenBLAS 0.3.21 runs that as a full
GEMM that packs the weights first. `native/small_gemm.c` defines a `cblas_sgemm` of its own, loaded
before OpenBLAS so that MLX's calls reach it: products of at most 64 rows it computes streaming each
weight row once (a step is memory-bound, so this shortens a one-token forward by about a third;
see docs/cpu-backend.md), every other call it hands to OpenBLAS unchanged. It is compiled
once per machine (gcc or cc, -O3 -march=native -fopenmp) into the user cache; without a compiler, or
with MLX_SPECDEC_NO_SMALL_GEMM=1, OpenBLAS does everything as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

CANDIDATES = ("libopenblas.so.0", "libopenblasp-r0.so", "libopenblas.so")
SMALL_GEMM_SOURCE = Path(__file__).parent / "native" / "small_gemm.c"
SMALL_GEMM_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")

#: What was loaded, for the environment row of every benchmark.
loaded_blas: str = "none"
#: The small-row GEMM library when it is in front of OpenBLAS (its call counters: `small_gemm_counts`).
small_gemm: Optional[ctypes.CDLL] = None


def _cache_dir() -> Path:
    # model/default.home() without importing the package's modules (this runs before mlx loads)
    env = os.environ.get("MLX_SPECDEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlx-specdec"


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def build_small_gemm() -> Optional[Path]:
    """The compiled library for this machine (built once into the user cache), or None."""
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None or not SMALL_GEMM_SOURCE.exists():
        return None
    source = SMALL_GEMM_SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(SMALL_GEMM_FLAGS).encode() + _cpu_signature().encode()
                         + compiler.encode()).hexdigest()[:16]
    target = _cache_dir() / "native" / f"small_gemm-{key}.so"
    if target.exists():
        return target
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([compiler, *SMALL_GEMM_FLAGS, str(SMALL_GEMM_SOURCE), "-o", str(partial)],
                       check=True, capture_output=True, timeout=120)
        partial.replace(target)  # a half-written library is never loaded
    except (OSError, subprocess.SubprocessError):
        partial.unlink(missing_ok=True)  # a compiler that failed: OpenBLAS alone, nothing left behind
        return None
    return target


def preload_openblas() -> str:
    global loaded_blas, small_gemm
    if sys.platform != "linux" or os.environ.get("MLX_SPECDEC_NO_OPENBLAS"):
        loaded_blas = "Accelerate" if sys.platform == "darwin" else "reference"
        return loaded_blas
    if "mlx.core" in sys.modules:
        # Too late to win symbol resolution; say so honestly in the environment row.
        loaded_blas = "reference (mlx imported before mlx_specdec)"
        return loaded_blas
    for name in CANDIDATES:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_LOCAL)  # present? (not yet in the global scope)
        except OSError:
            continue
        front = _load_small_gemm()  # before OpenBLAS joins the global scope: MLX's calls reach it first
        openblas = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        loaded_blas = f"OpenBLAS ({name})"
        if front is not None:
            front.small_gemm_init(ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p))
            small_gemm = front
            loaded_blas += " + small-row GEMM (native/small_gemm.c)"
        return loaded_blas
    loaded_blas = "reference (install libopenblas0-pthread for ~10x faster CPU matmuls)"
    return loaded_blas


def _load_small_gemm() -> Optional[ctypes.CDLL]:
    if os.environ.get("MLX_SPECDEC_NO_SMALL_GEMM"):
        return None
    library = build_small_gemm()
    try:
        return ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL) if library else None
    except OSError:
        return None


def small_gemm_counts() -> tuple:
    """(calls computed by the small-row GEMM, calls handed to OpenBLAS) so far in this process."""
    if small_gemm is None:
        return (0, 0)
    here, forwarded = ctypes.c_long(), ctypes.c_long()
    small_gemm.small_gemm_counts(ctypes.byref(here), ctypes.byref(forwarded))
    return (here.value, forwarded.value)


preload_openblas()
