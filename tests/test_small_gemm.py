"""The small-row GEMM in front of OpenBLAS (mlx_specdec/native/small_gemm.c, _blas.py): MLX's float32
products of up to 64 rows reach it, equal float64 references, a row's bits do not depend on the
rows beside it, everything else is OpenBLAS's; built once per machine into the user cache."""

import mlx_specdec  # noqa: F401  (preloads BLAS before mlx)

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec import _blas

active = pytest.mark.skipif(_blas.small_gemm is None, reason="no small-row GEMM here (not Linux, no compiler or no OpenBLAS)")


def reference(a, b):
    return np.array(a).astype(np.float64) @ np.array(b).astype(np.float64)


@active
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 17, 64])
@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (1003, 64), (49, 70), (7, 3)])  # 1003 keys x head dim
def test_products_of_few_rows_equal_a_float64_reference_in_both_weight_layouts(rows, n, k):
    x = mx.random.normal((rows, k), key=mx.random.key(rows))
    w = mx.random.normal((n, k), key=mx.random.key(n + k))  # (out, in) as nn.Linear keeps it
    before = _blas.small_gemm_counts()[0]
    row_major = x @ w.T  # B transposed: the engine's row-major weights
    column_major = x @ mx.contiguous(w.T)  # B as is: column-major weights (model/cpu_layout.py)
    mx.eval(row_major, column_major)
    expected = reference(x, w.T)
    np.testing.assert_allclose(np.array(row_major), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(column_major), expected, rtol=1e-4, atol=1e-4)
    assert _blas.small_gemm_counts()[0] == before + 2  # both computed here


@active
def test_many_rows_strides_and_scaling_are_still_right():
    w = mx.random.normal((300, 64), key=mx.random.key(1))
    big = mx.random.normal((100, 64), key=mx.random.key(2))
    forwarded = _blas.small_gemm_counts()[1]
    out = big @ w.T  # a prefill's 100 rows: OpenBLAS
    mx.eval(out)
    assert _blas.small_gemm_counts()[1] == forwarded + 1
    np.testing.assert_allclose(np.array(out), reference(big, w.T), rtol=1e-4, atol=1e-4)
    wide = mx.random.normal((4, 200), key=mx.random.key(3))
    x = wide[:, 10:74]  # rows 200 floats apart
    c = mx.random.normal((4, 300), key=mx.random.key(4))
    out = mx.addmm(c, x, w.T, alpha=0.5, beta=2.0)  # C = 0.5 x @ W.T + 2 C
    np.testing.assert_allclose(np.array(out), 0.5 * reference(x, w.T) + 2.0 * np.array(c), rtol=1e-4, atol=1e-4)


@active
@pytest.mark.parametrize("rows", [2, 5, 6, 7, 8, 13, 15])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("n,k", [(2000, 576), (1003, 64)])  # weights; attention over 1003 keys (8 at once from 4 rows)
def test_a_row_gets_the_same_bits_alone_or_among_others(transposed, rows, n, k):
    x = mx.random.normal((rows, k), key=mx.random.key(5))
    w = mx.random.normal((n, k), key=mx.random.key(6))
    b = w.T if transposed else mx.contiguous(w.T)
    together = x @ b
    alone = [x[i:i + 1] @ b for i in range(rows)]
    mx.eval(together, *alone)
    for i in range(rows):
        assert np.array_equal(np.array(together[i]), np.array(alone[i][0]))


def compiler_takes_the_flags(folder) -> bool:
    """A C compiler here that builds with the library's flags (-fopenmp, -march=native: GCC's;
    Apple's clang refuses -fopenmp)."""
    compiler = _blas.shutil.which(os.environ.get("CC", "gcc")) or _blas.shutil.which("cc")
    if compiler is None:
        return False
    (folder / "probe.c").write_text("int probe(void) { return 0; }\n")
    done = subprocess.run([compiler, *_blas.SMALL_GEMM_FLAGS, str(folder / "probe.c"), "-o", str(folder / "probe.so")],
                          capture_output=True, timeout=120)
    return done.returncode == 0


def test_the_library_is_built_once_into_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path))
    if not compiler_takes_the_flags(tmp_path):
        pytest.skip("no C compiler here that takes -fopenmp -march=native")
    built = _blas.build_small_gemm()
    assert built is not None and built.parent == tmp_path / "native" and built.exists()
    stamp = built.stat().st_mtime_ns
    assert _blas.build_small_gemm() == built and built.stat().st_mtime_ns == stamp  # not compiled again
    monkeypatch.setattr(_blas.shutil, "which", lambda name: None)
    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path / "elsewhere"))
    assert _blas.build_small_gemm() is None  # no compiler: OpenBLAS alone


def test_it_can_be_turned_off():
    code = "import mlx_specdec, mlx_specdec._blas as b; print(b.loaded_blas); print(b.small_gemm_counts())"
    env = dict(os.environ, MLX_SPECDEC_NO_SMALL_GEMM="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "small-row" not in out.stdout and "(0, 0)" in out.stdout


def test_a_compiler_that_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    if _blas.shutil.which(os.environ.get("CC", "gcc")) is None and _blas.shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(_blas, "SMALL_GEMM_FLAGS", _blas.SMALL_GEMM_FLAGS + ("-no-such-flag",))
    assert _blas.build_small_gemm() is None
    assert list((tmp_path / "native").iterdir()) == []
