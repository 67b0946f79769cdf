"""mlx-specdec: fast, lossless LLM decoding on MLX.

Importing the package first preloads the system BLAS (see `_blas`), so import `mlx_specdec`
before `mlx.core` in programs that use both.
"""

from . import _blas  # noqa: F401  (must precede every mlx import)

__version__ = "0.1.0"
