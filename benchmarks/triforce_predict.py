"""Predict TriForce's speed-up for a bigger target on an Apple-silicon GPU from a cost model.

    python benchmarks/triforce_predict.py [--bandwidth 400] [--context 8192] [--budget 512]
        [--tokens-per-full-forward 5.0] [--middle-forwards-per-round 3.0] [--middle-rows 3.0]
        [--gamma 6]

Decoding a 7B model on a Mac is memory-bound: a forward costs the bytes it reads over the
bandwidth it gets. A forward of m rows over a cache of n tokens reads the weights once and
the KV of n tokens once:

    T(m, n) = (W * qmm(m) + n * kv_per_token) / (efficiency * bandwidth)

where qmm(m) is how much more a 4-bit matmul of m rows costs than one row on Apple GPUs
(measured by MLX users on an M4 Pro with MLX 0.32's qmv_wide, ml-explore/mlx#3839, on
Llama-7B-like 4096-wide shapes: about 1.2x at 2 rows, 1.5x at 4, 2.0x at 6-7, 2.3x at 8; flat
would be 1.0). Attention's KV read is shared by the rows (one fused kernel per layer).

A TriForce round: `middle_forwards` forwards of `middle_rows` rows over the retrieval cache
(budget + generated tokens), then one full-cache verify of gamma + 1 rows, and it commits
`tokens_per_full_forward` tokens. Plain decoding pays T(1, context) per token, so

    speed-up = tokens_per_full_forward * T(1, ctx) / (middle_forwards * T(rows, budget) + T(gamma+1, ctx))

The per-round figures default to what `bench --context-length 6k --methods ar,triforce` measured
on this project's CPU (the acceptances depend on the model and text, not on the device); pass
your own. Vicuna-7B: 32 layers, 32 KV heads of 128 (no GQA), 6.74e9 parameters; 4-bit, group 64
(4.5 bits a weight with the scales) = 3.79 GB; float16 KV = 2 x 32 x 4096 x 2 B = 0.52 MB a token.
"""

import argparse

QMM = {1: 1.0, 2: 1.17, 3: 1.36, 4: 1.43, 5: 1.7, 6: 1.9, 7: 2.05, 8: 2.2}  # ml-explore/mlx#3839, 4096-wide


def qmm(rows: float) -> float:
    low = max(1, min(8, int(rows)))
    high = min(8, low + 1)
    frac = min(max(rows - low, 0.0), 1.0)
    return QMM[low] + (QMM[high] - QMM[low]) * frac


def forward_ms(rows: float, cached: float, args) -> float:
    bytes_read = args.weights_gb * 1e9 * qmm(rows) + cached * args.kv_mb_per_token * 1e6
    return 1e3 * bytes_read / (args.efficiency * args.bandwidth * 1e9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidth", type=float, default=400.0, help="GB/s (M1/M2/M3 Max 400, M4 Max 546, Ultra 800, M4 Pro 273)")
    p.add_argument("--efficiency", type=float, default=0.75, help="share of the bandwidth a decode step gets")
    p.add_argument("--weights-gb", type=float, default=3.79, help="Vicuna-7B 4-bit, group 64")
    p.add_argument("--kv-mb-per-token", type=float, default=0.524, help="Vicuna-7B float16 KV")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--generated", type=int, default=64, help="tokens generated so far (they sit in both caches)")
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--tokens-per-full-forward", type=float, default=5.0)
    p.add_argument("--middle-forwards-per-round", type=float, default=3.0)
    p.add_argument("--middle-rows", type=float, default=3.0, help="tokens fed per middle forward (1 + bottom drafts)")
    args = p.parse_args()

    step = forward_ms(1, args.context, args)
    verify = forward_ms(args.gamma + 1, args.context, args)
    middle = forward_ms(args.middle_rows, args.budget + args.generated, args)
    round_ms = args.middle_forwards_per_round * middle + verify
    speedup = args.tokens_per_full_forward * step / round_ms
    print(f"plain step at {args.context}: {step:.1f} ms ({1e3 / step:.1f} tok/s) | full verify of {args.gamma + 1}: "
          f"{verify:.1f} ms ({verify / step:.2f}x a step) | middle forward of {args.middle_rows:g} rows over "
          f"{args.budget + args.generated}: {middle:.1f} ms ({middle / step:.2f}x)")
    print(f"round: {args.middle_forwards_per_round:g} x {middle:.1f} + {verify:.1f} = {round_ms:.1f} ms for "
          f"{args.tokens_per_full_forward:g} tokens -> {1e3 * args.tokens_per_full_forward / round_ms:.1f} tok/s, "
          f"speed-up {speedup:.2f}x over plain decoding")
    flat = args.tokens_per_full_forward * step / (
        args.middle_forwards_per_round * (forward_ms(1, args.budget + args.generated, args))
        + forward_ms(1, args.context, args))
    print(f"if a few-row 4-bit matmul cost what one row does (qmm flat, the bandwidth bound): {flat:.2f}x")


if __name__ == "__main__":
    main()
