"""Can a speculative verify flip a greedy argmax? One-token steps vs multi-token verify logits.

    python benchmarks/tie_flips.py [--dtype float32|float16] [--prompts 16] [--tokens 64]
                                   [--windows cycle|all] [--verify tree|causal] [-o FILE [--append]]

Speculative methods claim greedy output identical to plain decoding (`ar`). In exact arithmetic
it is: a verify forward over T query tokens computes the same function as T one-token steps. In
floating point the T-token forward sums in another order (other matmul shapes, another attention
call), so its logits differ from the step's by rounding, and where the top-2 logits are nearly
tied the argmax can flip. This measures how close that edge is on the real default model.

For each of the first --prompts prompts of benchmarks/prompts.jsonl (chat template applied), it
decodes --tokens tokens greedily exactly as `ar` does (prefill, then one-token forwards on a
contiguous cache) and keeps every step's logits. Then, at every start position j of the greedy
continuation, it rolls the same cache back to j and runs one verify forward over the next T
tokens at once (one T per j, cycling 2..6, with --windows cycle; T = 2..6 with --windows all),
as ReDrafter verifies a chain of drafts (`--verify tree`: per-token positions and an explicit
tree mask, the call `decoding/redrafter.py` makes; `--verify causal`: the plain causal forward).
Each of the T positions' logits is compared with the step's logits of the same position:

    max |d logit|        over every logit of every comparison
    max |d margin|       change of the step's top-1 minus top-2 gap
    margin distribution  the step's top-1 / top-2 gap over the positions
    at risk              positions whose margin is below max |d logit| (and below 2x: the strict
                         bound, the top-1 may drop and the top-2 rise by d each)
    flips                comparisons whose argmax differs from the step's

And over whole sequences: a perfect-draft "chained verify" (windows of T tokens back to back,
each committing its own K/V as a speculative decoder does; does its argmax ever leave `ar`'s
sequence?) and the real `redrafter` (shipped head, default beams) against the engine's `ar`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from tqdm import tqdm

from mlx_specdec import masks
from mlx_specdec._blas import loaded_blas
from mlx_specdec.bench import DEFAULT_PROMPTS, load_prompts
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine
from mlx_specdec.model.forward import forward

T_RANGE = (2, 3, 4, 5, 6)


def top2_margin(logits: np.ndarray) -> np.ndarray:
    """(..., V) -> (...) top-1 minus top-2 logit."""
    part = np.partition(logits, -2, axis=-1)
    return part[..., -1] - part[..., -2]


def greedy_steps(model, prompt, tokens: int, eos=()):
    """`ar`'s computation: prefill prompt[:-1], then one-token forwards, up to `tokens` or an EOS.
    Returns the cache (at the end of the run), the sequence prompt + continuation, and the
    (K, V) float32 step logits (K <= tokens)."""
    cache = ContiguousKVCache.for_model(model)
    if len(prompt) > 1:
        forward(model, mx.array(prompt[:-1])[None], cache, logits_for="none")
        mx.eval(cache.state)
    seq, rows, token = list(prompt), [], prompt[-1]
    for _ in range(tokens):
        logits = forward(model, mx.array([[token]]), cache, logits_for="last").logits[0, -1]
        row = np.array(logits.astype(mx.float32))
        rows.append(row)
        token = int(row.argmax())  # mx.argmax and np.argmax both take the first of equal maxima
        seq.append(token)
        if token in eos:
            break
    return cache, seq, np.stack(rows)


def verify_forward(model, cache, tokens, start: int, kind: str) -> np.ndarray:
    """One T-token verify forward on `cache` (holding `start` tokens): (T, V) float32 logits."""
    T = len(tokens)
    if kind == "tree":  # as ReDrafter: a chain is a tree with parents -1, 0, 1, ...
        parents = [[-1] + list(range(T - 1))]
        valid = np.ones((1, start), dtype=bool)
        out = forward(model, mx.array(tokens)[None], cache,
                      positions=masks.ragged_tree_positions([start], parents, T),
                      mask=masks.ragged_tree_mask(valid, parents, T))
    else:
        out = forward(model, mx.array(tokens)[None], cache)
    return np.array(out.logits[0].astype(mx.float32))


def windows_for(tokens: int, mode: str):
    """(start j, T) pairs: window j covers the step positions j .. j + T - 1."""
    if mode == "all":
        return [(j, T) for T in T_RANGE for j in range(tokens - T + 1)]
    pairs = []
    for j in range(tokens):
        T = T_RANGE[j % len(T_RANGE)]
        if j + T <= tokens:
            pairs.append((j, T))
    return pairs


def chained_verify(model, prompt, seq, tokens: int, T: int, kind: str):
    """Perfect drafts verified T at a time, each window's K/V committed (never the steps').
    Returns the positions whose verify argmax differs from `ar`'s token."""
    cache = ContiguousKVCache.for_model(model)
    if len(prompt) > 1:
        forward(model, mx.array(prompt[:-1])[None], cache, logits_for="none")
        mx.eval(cache.state)
    P = len(prompt) - 1
    mismatches = []
    for j in range(0, tokens, T):
        width = min(T, tokens - j)
        logits = verify_forward(model, cache, seq[P + j: P + j + width], P + j, kind)
        mx.eval(cache.state)
        for i, row in enumerate(logits):
            if int(row.argmax()) != seq[P + j + i + 1]:
                mismatches.append(j + i)
    return mismatches


def engine_tokens(engine, prompt, method, tokens, **options):
    params = GenerationParams(max_tokens=tokens, options=options)
    events = list(engine.generate_ids(list(prompt), method, params))
    return [t for e in events if e.kind == "token" for t in e.tokens], events[-1].stats


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(args):
    engine = Engine.load(args.model, dtype=args.dtype, drafter="auto" if args.redrafter else None,
                         apar_adapter=None)
    lm = engine.lm
    model = lm.model
    prompts = [lm.encode_prompt(p.text) for p in load_prompts(args.prompt_file, args.prompts)]
    pairs = windows_for(args.tokens, args.windows)
    head = engine.drafter if args.redrafter else None

    margins = []  # per prompt: the step margins
    max_d, max_dm, comparisons, flips = 0.0, 0.0, 0, []
    chain_div, rd_div, rd_same, ar_same, rd_tpf = [], [], 0, 0, []
    bar = tqdm(total=len(prompts) * (args.tokens + len(pairs)), unit="fwd", desc=args.dtype,
               dynamic_ncols=True)
    start = time.perf_counter()
    for n, prompt in enumerate(prompts):
        P = len(prompt) - 1
        cache, seq, steps = greedy_steps(model, prompt, args.tokens, lm.eos_token_ids)
        K = len(steps)
        bar.update(args.tokens)
        m = top2_margin(steps)
        margins.append(m)
        top = np.argsort(steps, axis=1)[:, -2:]  # (K, 2): top-2, top-1 last
        for j, T in pairs:
            if j + T > K:  # stopped at an EOS
                bar.update(1)
                continue
            cache.rollback_to(P + j)
            logits = verify_forward(model, cache, seq[P + j: P + j + T], P + j, args.verify)
            for i in range(T):
                k = j + i
                d = np.abs(logits[i] - steps[k])
                max_d = max(max_d, float(d.max()))
                a, b = top[k, 1], top[k, 0]
                max_dm = max(max_dm, abs(float((logits[i, a] - logits[i, b]) - (steps[k, a] - steps[k, b]))))
                comparisons += 1
                if int(logits[i].argmax()) != int(steps[k].argmax()):
                    flips.append((n, k, T, i, float(m[k])))
            bar.update(1)
        chain_div.append(chained_verify(model, prompt, seq, K, args.chain_T, args.verify))
        if head is not None:
            want, _ = engine_tokens(engine, prompt, "ar", args.tokens)
            got, stats = engine_tokens(engine, prompt, "redrafter", args.tokens)
            ar_same += want == seq[P + 1: P + 1 + len(want)]
            rd_same += got == want
            rd_tpf.append(stats.tokens_per_forward)
            d = first_difference(got, want)
            if d is not None:
                rd_div.append((n, d, float(m[d]) if d < len(m) else float("nan")))
        bar.set_postfix(max_d=f"{max_d:.2g}", flips=len(flips))
    bar.close()
    elapsed = time.perf_counter() - start

    margins = np.concatenate(margins)
    positions = margins.size
    q = np.quantile(margins, [0.01, 0.1, 0.5])
    risk1 = int((margins < max_d).sum())
    risk2 = int((margins < 2 * max_d).sum())
    chain_prompts = sum(1 for c in chain_div if c)
    chain_pos = sum(len(c) for c in chain_div)

    env = (f"{platform.machine()}, {os.cpu_count()} cores, mlx {mx.__version__} ({mx.default_device()}), "
           f"BLAS: {loaded_blas}, model {lm.describe()}")
    lines = [
        f"### {args.dtype}: {len(prompts)} prompts x {args.tokens} greedy tokens, "
        f"verify `{args.verify}`, windows `{args.windows}` (T = {T_RANGE[0]}..{T_RANGE[-1]})",
        "",
        f"{env}; {elapsed:.0f} s.",
        "",
        "| positions | comparisons | max \\|Δlogit\\| | max \\|Δ(top1−top2)\\| | margin min | p1 | p10 | median "
        "| margin < 1e-3 | at risk: margin < max\\|Δ\\| | < 2·max\\|Δ\\| | argmax flips |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {positions} | {comparisons} | {max_d:.3g} | {max_dm:.3g} | {margins.min():.3g} | {q[0]:.3g} "
        f"| {q[1]:.3g} | {q[2]:.3g} | {int((margins < 1e-3).sum())} | {risk1} | {risk2} | {len(flips)} |",
        "",
        "| whole sequences | diverged | detail |",
        "|---|---:|---|",
        f"| chained verify (perfect drafts, T = {args.chain_T}, verify K/V committed) vs `ar` "
        f"| {chain_prompts} / {len(prompts)} | {chain_pos} positions whose verify argmax ≠ `ar` |",
    ]
    if head is not None:
        detail = "; ".join(f"prompt {n + 1} at token {d} (margin {mm:.3g})" for n, d, mm in rd_div) or "none"
        lines.append(
            f"| `redrafter` (shipped head, default beams) vs `ar` | {len(prompts) - rd_same} / {len(prompts)} "
            f"| {detail}; {np.mean(rd_tpf):.2f} tokens/forward; this script's steps = engine `ar` "
            f"on {ar_same} / {len(prompts)} |")
    elif args.redrafter:
        lines.append("| `redrafter` | - | no shipped draft head for this model |")
    if flips:
        lines += ["", "Flips (prompt, position, T, index in window, step margin): "
                  + ", ".join(f"({n + 1}, {k}, {T}, {i}, {mm:.3g})" for n, k, T, i, mm in flips[:20])]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", type=int, default=16, help="the first N prompts (default 16)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    parser.add_argument("--prompt-file", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--windows", choices=["all", "cycle"], default="cycle",
                        help="cycle (default): one T per start, cycling 2..6, so each position is compared "
                             "at ~4 window places; all: every T at every start (5x the verify forwards)")
    parser.add_argument("--verify", choices=["tree", "causal"], default="tree",
                        help="tree: ReDrafter's call (positions + explicit mask); causal: plain forward")
    parser.add_argument("--chain-T", type=int, default=5, help="window of the chained verify (default 5)")
    parser.add_argument("--no-redrafter", dest="redrafter", action="store_false",
                        help="skip the engine's ar vs redrafter comparison")
    parser.add_argument("-o", "--output", type=Path, help="also write the markdown here")
    parser.add_argument("--append", action="store_true", help="append to --output instead of overwriting")
    args = parser.parse_args(argv)
    if args.tokens < max(T_RANGE):
        parser.error(f"--tokens must be at least {max(T_RANGE)}")
    text = run(args)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "a" if args.append else "w") as f:
            f.write(("\n" if args.append and args.output.exists() and args.output.stat().st_size else "") + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
