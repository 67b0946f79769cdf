"""mlx-specdec: fast, lossless LLM decoding on MLX.

Importing the package first preloads the system BLAS (see `_blas`), tunes glibc's malloc for
MLX's CPU arrays (see `_allocator`) and has MLX build its CPU kernels for this CPU (see `_jit`),
so import `mlx_specdec` before `mlx.core` in programs that use both.
"""

from . import _allocator  # noqa: F401  (before any MLX allocation)
from . import _blas  # noqa: F401  (must precede every mlx import)
from . import _jit  # noqa: F401  (MLX's CPU kernels built for this CPU)

__version__ = "0.1.0"
