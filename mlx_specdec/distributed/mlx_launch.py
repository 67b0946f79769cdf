"""`mlx.launch`, MLX's own launcher, without its busy loops (run as `python -m` this module).

mlx.launch (MLX 0.32) relays each rank's output in a thread that calls
`select(outputs, [the rank's stdin], [], 1.0)`; a pipe with room is always writable, so that
select returns at once and the thread spins; and its main loop polls our stdin the same way
when stdin is at end of file. The launcher then keeps a core busy for the whole run, and on a
machine with few cores the ranks' layers run much slower beside it.
This module runs the same `main` with `select` asked only about readable outputs (we send the
ranks no input), and the caller gives it a stdin pipe that stays open and empty. Where MLX's
launcher has another shape, it runs unchanged.
"""

import select as _select
import sys


def _readable_only(rlist, wlist, xlist, timeout=None):
    readable, _, errors = _select.select(rlist, [], xlist, timeout)
    return readable, [], errors


def main() -> int:
    from mlx._distributed_utils import launch

    if hasattr(launch, "select") and hasattr(launch, "_launch_with_io"):
        launch.select = _readable_only
    sys.argv[0] = "mlx.launch"
    return launch.main()


if __name__ == "__main__":
    sys.exit(main())
