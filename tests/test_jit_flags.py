"""MLX's CPU kernels built for this CPU (mlx_specdec/_jit.py): the wrapper is found first, never
calls itself, keeps Python's temporary folder, can be turned off, and every fused kernel returns
the same bits as MLX's own build of it (a child process without the flags, fresh kernel folder)."""

import mlx_specdec  # noqa: F401  (preloads BLAS before mlx)

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mlx_specdec import _jit

active = pytest.mark.skipif(_jit.jit_flags == "MLX's own",
                            reason="not a Linux x86-64 CPU with AVX2/FMA/F16C and g++ (or turned off)")

# Fused kernels whose rounding a compiler could change: products added (contraction into an FMA),
# MLX's exp and sigmoid (its polynomial, and the loops vectorized around it), mlx-lm's SwiGLU,
# RMSNorm, the attention's fast exp (Horner), RoPE's rotation, and float16.
KERNELS = r"""
import mlx_specdec, json, sys
import mlx.core as mx, numpy as np
from mlx_lm.models.activations import swiglu
from mlx_specdec.model.attention import fast_exp
import mlx.nn as nn
k = mx.random.key(7)
a, b, c = (mx.random.normal((3, 1000), key=mx.random.key(i)) * 4 for i in range(3))
# the edges of MLX's exp and sigmoid (its clamps at +-88, inf, nan, -0, subnormals) and large values
edges = np.array([np.inf, -np.inf, np.nan, 88.0, 88.5, -88.0, -88.5, 87.9, -87.9, -0.0, 0.0, 1e-40, -1e-40,
                  3e38, -3e38, 100.0, -100.0, 0.5, -0.5, 1.0, -1.0], dtype=np.float32)
a = mx.concatenate([a.reshape(-1), mx.array(edges)]).reshape(3, -1)
b, c = (mx.concatenate([x.reshape(-1), mx.ones(21)]).reshape(3, -1) for x in (b, c))
out = {
    "muladd": mx.compile(lambda a, b, c: a * b + c)(a, b, c),
    "exp": mx.compile(lambda a: mx.exp(a) * 2)(a),
    "sigmoid": mx.compile(lambda a: mx.sigmoid(a) + 1)(a),
    "swiglu": swiglu(a, b),
    "fast_exp": fast_exp(-mx.abs(a), mx.array(0.5)),
    "rms_norm": mx.compile(lambda a, b: a * mx.rsqrt(mx.mean(a * a, axis=-1, keepdims=True) + 1e-5) * b)(
        mx.where(mx.isfinite(a), a, 1.0), b),
    "rope": nn.RoPE(64)(mx.random.normal((1, 2, 5, 64), key=k), offset=37),
    "swiglu16": swiglu(a.astype(mx.float16), b.astype(mx.float16)).astype(mx.float32),
}
mx.eval(out)
# a NaN's sign means nothing (an inlined exp may give -nan where the call gave nan): one NaN for all
print(json.dumps({name: int(np.where(np.isnan(np.array(v)), np.float32(np.nan), np.array(v)).view(np.uint32)
                            .astype(np.uint64).sum()) for name, v in out.items()}))
"""


def run_kernels(env) -> dict:
    done = subprocess.run([sys.executable, "-c", KERNELS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@active
def test_the_wrapper_comes_first_and_never_calls_itself():
    folder = Path(os.environ["TMPDIR"])
    assert shutil.which("g++") == str(folder / "bin" / "g++")
    script = (folder / "bin" / "g++").read_text()
    real = script.split("exec '", 1)[1].split("'", 1)[0]
    assert not Path(real).resolve().is_relative_to((folder.parent).resolve())  # the system's compiler
    assert all(flag in script for flag in _jit.JIT_FLAGS)
    assert tempfile.gettempdir() != str(folder)  # Python's temporary files stay in the system's folder


@active
def test_every_fused_kernel_has_the_bits_of_mlxs_own_build(tmp_path):
    ours = run_kernels(dict(os.environ))
    mlx_own = run_kernels(_jit.env_with_mlx_flags(str(tmp_path)))
    assert list((tmp_path / "mlx").glob("*/cpu/*.so")), "the child built its kernels with MLX's flags"
    assert ours == mlx_own


def test_turned_off_it_leaves_path_and_tmpdir_alone(tmp_path):
    env = dict(os.environ, MLX_SPECDEC_NO_JIT_FLAGS="1", TMPDIR=str(tmp_path), PATH="/usr/bin:/bin")
    code = "import mlx_specdec, os; from mlx_specdec import _jit; print(_jit.jit_flags, os.environ['TMPDIR'], os.environ['PATH'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == f"MLX's own {tmp_path} /usr/bin:/bin"
