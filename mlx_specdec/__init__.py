"""mlx-specdec: fast, lossless LLM decoding on MLX.

Importing the package first preloads the system BLAS (see `_blas`) and tunes glibc's malloc
for MLX's CPU arrays (see `_allocator`), so import `mlx_specdec` before `mlx.core` in programs
that use both.
"""

from . import _allocator  # noqa: F401  (before any MLX allocation)
from . import _blas  # noqa: F401  (must precede every mlx import)

__version__ = "0.1.0"
