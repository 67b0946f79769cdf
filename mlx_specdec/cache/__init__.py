"""KV caches behind one small duck-typed interface (`.layers[i].update_and_fetch`, `.offset`).

- `ContiguousKVCache`: one sequence, with trim / rollback / keep-accepted-path (speculation).
- `ForkableKVCache`: many threads sharing prefixes in one slot pool, freed early (APAR).
- `SparseKVView`: read-only view attending to chosen positions of a contiguous cache.
- `RetrievalKVCache`: TriForce's retrieval cache, the prompt's best chunks copied once into a
  small buffer of its own (`QueryRecorder` captures the queries that score them).
- `StreamingKVCache`: StreamingLLM's sink + recent window (TriForce's bottom-level draft model).
"""

from .contiguous import ContiguousKVCache, ContiguousLayerCache
from .forkable import ForkableKVCache
from .retrieval import QueryRecorder, RetrievalKVCache
from .sparse import SparseKVView
from .streaming import StreamingKVCache

__all__ = ["ContiguousKVCache", "ContiguousLayerCache", "ForkableKVCache", "QueryRecorder", "RetrievalKVCache",
           "SparseKVView", "StreamingKVCache"]
