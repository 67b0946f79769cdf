"""Pipeline-parallel decoding over `mx.distributed` (PipeInfer and its baselines).

- `split.py`   which layers each rank holds
- `link.py`    ordered messages between ranks (send/recv threads, emulated link delay, timeouts)
- `stage.py`   a rank's slice of the model, its KV cache, and the worker loop
- `coordinator.py` rank 0: pp-ar, pp-spec and pipeinfer (scheduling, verification, cancellation)
- `drafters.py` chain drafts for the head (n-gram lookup, the ReDrafter head, scripted)
- `rank.py`    the program `mlx.launch` starts on every rank
- `launch.py`  starting the ranks and reading the head's events (CLI, bench and tests)
"""

from .coordinator import METHODS  # noqa: F401
