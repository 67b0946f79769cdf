"""MLX's fused CPU kernels built with MLX's own flags and with this CPU's (mlx_specdec/_jit.py).

    python benchmarks/jit_flags_ab.py [--rounds 3]

Times mlx-lm's compiled SwiGLU (the MLP's `silu(gate) * up`, the default model's sizes: 1536 wide,
30 layers' worth per evaluation) for 1 and 5 query tokens, in child processes that alternate:
one with the flags (the user cache's kernel folder), one without (a fresh kernel folder, so MLX
builds its own). Prints the medians and checks that both give the same bits.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import mlx_specdec  # noqa: F401  (sets the flags up in this process, so os.environ has them)
from mlx_specdec import _jit

CHILD = r"""
import json, time
import mlx_specdec
import mlx.core as mx, numpy as np
from mlx_lm.models.activations import swiglu
out = {}
for tokens in (1, 5):
    gate, up = (mx.random.normal((1, tokens, 1536), key=mx.random.key(i)) * 3 for i in (1, 2))
    mx.eval(gate, up)
    times = []
    for _ in range(60):
        start = time.perf_counter()
        mx.eval([swiglu(gate + 0.001 * k, up) for k in range(30)])  # a forward's 30 layers
        times.append(time.perf_counter() - start)
    adds = []
    for _ in range(60):
        start = time.perf_counter()
        mx.eval([gate + 0.001 * k for k in range(30)])  # the same without the SwiGLU
        adds.append(time.perf_counter() - start)
    bits = int(np.array(swiglu(gate, up)).view(np.uint32).astype(np.uint64).sum())
    out[tokens] = [1e3 * (float(np.median(times)) - float(np.median(adds))), bits]
print(json.dumps(out))
"""


def child(env) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if _jit.jit_flags == "MLX's own":
        raise SystemExit("the flags do not apply here (not a Linux x86-64 CPU with AVX2/FMA/F16C and g++)")
    print(f"30 SwiGLU kernels (1536 wide) less 30 adds, ms; flags: {_jit.jit_flags}")
    print("| round | T | MLX's flags | this CPU's | same bits |")
    print("|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as fresh:
        env = _jit.env_with_mlx_flags(fresh)
        for round_ in range(args.rounds):
            own, fast = child(env), child(dict(os.environ))
            for tokens in ("1", "5"):
                print(f"| {round_ + 1} | {tokens} | {own[tokens][0]:.2f} | {fast[tokens][0]:.2f} | "
                      f"{own[tokens][1] == fast[tokens][1]} |", flush=True)


if __name__ == "__main__":
    main()
