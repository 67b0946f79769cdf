"""Have MLX compile its CPU kernels for this CPU's vector unit, with the same bits.

MLX fuses elementwise ops on the CPU (`mx.compile`, and mlx-lm's SwiGLU is compiled) into C++ it
builds at run time with `g++ -std=c++17 -O3 -fPIC -shared`: no -mfma, so every `fma` in MLX's
`exp` is a call into libm, and `floor` another. The MLP's `silu(gate) * up` is then slow per
element, and it grows with the query count: a large part of what a verify costs beyond one token.

On Linux x86-64 CPUs with AVX2, FMA and F16C this puts a `g++` in front of the system's that adds
`-mavx2 -mfma -mf16c -ffp-contract=off` (what newer MLX adds itself, less the contraction: with
-mfma alone GCC fuses `a * b + c` in MLX's `exp`, and the logits' bits change), and
`-fno-trapping-math -finline-limit=300` (below: `exp` inlined, the loops vectorized). Each
operation then rounds exactly as before, so every kernel returns the same bits
(tests/test_jit_flags.py), and the SwiGLU kernels run many times faster (with the first four
flags `fma` is an instruction instead of a libm call, with the last two the loop is vectorized;
see docs/cpu-backend.md). MLX keeps the libraries it builds under `$TMPDIR/mlx/<version>/cpu`
and reuses any it finds, so the process's TMPDIR points to a folder of our own in the user cache
(keyed by CPU, compiler and flags); Python's `tempfile` keeps the system's temporary folder.
`MLX_SPECDEC_NO_JIT_FLAGS=1` leaves MLX as it is. Runs before MLX loads (`mlx_specdec/__init__.py`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from ._blas import _cache_dir, _cpu_signature

# -finline-limit lets GCC inline MLX's `exp` into the kernel's loop (it stays a call through the PLT
# otherwise) and -fno-trapping-math lets it turn the loop's selects into blends: the loop is then
# vectorized, 8 elements at a time. Neither flag changes a result (no contraction, no fast-math:
# only which floating-point exception flags a kernel may raise).
JIT_FLAGS = ("-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fno-trapping-math", "-finline-limit=300")
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")
SYSTEM_TMPDIR = "MLX_SPECDEC_SYSTEM_TMPDIR"  # the temporary folder before ours, for child processes

#: What was set, for the environment row of the benchmarks.
jit_flags: str = "MLX's own"


def path_without_wrappers(path: str) -> str:
    """PATH less our wrappers' folders (a child process inherits ours)."""
    own_root = (_cache_dir() / "jit").resolve()
    return os.pathsep.join(folder for folder in path.split(os.pathsep)
                           if folder and not Path(folder).resolve().is_relative_to(own_root))


def env_with_mlx_flags(kernel_folder: str) -> dict:
    """This process's environment for a child that lets MLX build with its own flags into
    `kernel_folder` (benchmarks and tests compare the two builds)."""
    env = dict(os.environ, MLX_SPECDEC_NO_JIT_FLAGS="1", PATH=path_without_wrappers(os.environ.get("PATH", "")),
               TMPDIR=kernel_folder)
    env.pop(SYSTEM_TMPDIR, None)
    return env


def _real_compiler() -> Optional[str]:
    """The system's g++, never one of our wrappers."""
    return shutil.which("g++", path=path_without_wrappers(os.environ.get("PATH", "")))


def _cpu_has_flags() -> bool:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
    except OSError:
        return False
    return all(flag in flags for flag in NEEDED_CPU_FLAGS)


def wrapper_folder() -> Optional[Path]:
    """The folder holding `bin/g++` (the wrapper) and MLX's kernels, made once per machine; None
    where this does not apply or the compiler refuses the flags."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64") or not _cpu_has_flags():
        return None
    compiler = _real_compiler()
    if compiler is None:
        return None
    key = hashlib.sha256((" ".join(JIT_FLAGS) + compiler + _cpu_signature()).encode()).hexdigest()[:16]
    folder = _cache_dir() / "jit" / key
    wrapper = folder / "bin" / "g++"
    if wrapper.exists():
        return folder
    try:
        (folder / "bin").mkdir(parents=True, exist_ok=True)
        probe = folder / "probe.cpp"
        probe.write_text("#include <cmath>\nextern \"C\" float f(float a, float b, float c) { return std::fma(a, b, c); }\n")
        subprocess.run([compiler, "-std=c++17", "-O3", "-fPIC", "-shared", *JIT_FLAGS, str(probe), "-o",
                        str(folder / "probe.so")], check=True, capture_output=True, timeout=120)
        partial = wrapper.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(f"#!/bin/sh\n# mlx-specdec: MLX's CPU kernels built for this CPU, the same bits (_jit.py)\n"
                           f"exec '{compiler}' \"$@\" {' '.join(JIT_FLAGS)}\n")
        partial.chmod(0o755)
        partial.replace(wrapper)  # a half-written wrapper is never run
    except (OSError, subprocess.SubprocessError):
        return None  # no usable compiler: MLX's own flags
    return folder


def use_jit_flags() -> str:
    global jit_flags
    if os.environ.get("MLX_SPECDEC_NO_JIT_FLAGS"):
        return jit_flags
    folder = wrapper_folder()
    if folder is None:
        return jit_flags
    system_tmp = os.environ.get(SYSTEM_TMPDIR) or tempfile.gettempdir()
    tempfile.tempdir = system_tmp  # Python's own temporary files stay where they were
    os.environ[SYSTEM_TMPDIR] = system_tmp
    os.environ["TMPDIR"] = str(folder)  # MLX: $TMPDIR/mlx/<version>/cpu, our kernels only
    path = os.environ.get("PATH", "")
    if not path.startswith(str(folder / "bin") + os.pathsep):  # a child process inherits ours
        os.environ["PATH"] = str(folder / "bin") + os.pathsep + path
    jit_flags = " ".join(JIT_FLAGS)
    return jit_flags


use_jit_flags()
