"""Keep freed memory in the process on Linux, so MLX's CPU arrays are not page-faulted anew.

glibc serves every allocation above its mmap threshold (128 KB, growing to at most 32 MB) with a
fresh `mmap`, and gives it back with `munmap` when freed. MLX on the CPU allocates each
intermediate array with malloc, so every score matrix of a long-context attention (a 6-token
verify over 8K keys: megabytes per array; a prefill chunk: hundreds of MB) arrived as untouched
pages and paid a page fault per 4 KB on first write. For an elementwise kernel such as the fused
fast exp those faults cost several times the arithmetic (see docs/cpu-backend.md).

Raising the mmap threshold (and the trim threshold, so freed heap is not returned either) keeps
those pages mapped for the next array. The cost: the process keeps its peak heap until it exits
(what a long-running inference engine reuses anyway). `MLX_SPECDEC_KEEP_GLIBC_MALLOC=1` opts out.
Runs before the first MLX allocation (`mlx_specdec/__init__.py` imports it first).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
THRESHOLD = 1 << 30  # 1 GB: every array below it comes from the reused heap

#: What was set, for the environment row of the benchmarks.
allocator: str = "system default"


def keep_freed_memory() -> str:
    global allocator
    if sys.platform != "linux" or os.environ.get("MLX_SPECDEC_KEEP_GLIBC_MALLOC"):
        return allocator
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2 * THRESHOLD) == 1
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return allocator
    if ok:
        allocator = "glibc, mmap/trim thresholds 1 GB/2 GB"
    return allocator


keep_freed_memory()
