"""KV caches behind one small duck-typed interface (`.layers[i].update_and_fetch`, `.offset`).

- `ContiguousKVCache`: one sequence, with trim / rollback / keep-accepted-path (speculation).
- `ForkableKVCache`: many threads sharing prefixes in one slot pool, freed early (APAR).
- `SparseKVView`: read-only view attending to chosen positions of a contiguous cache (TriForce).
"""

from .contiguous import ContiguousKVCache, ContiguousLayerCache
from .forkable import ForkableKVCache
from .sparse import SparseKVView

__all__ = ["ContiguousKVCache", "ContiguousLayerCache", "ForkableKVCache", "SparseKVView"]
