"""Quantize a float16 model with mlx-lm, save it, run one prompt through both, compare.

    python -m quantize.run --model default --bits 4 --group-size 64
    mlx-specdec quantize --model path/to/vicuna-7b-v1.5 --output vicuna-7b-4bit

Prints size on disk, bits per weight, decode tok/s of each and how many of the first N greedy
tokens agree.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import List

import mlx_specdec  # noqa: F401  (preloads BLAS before mlx)

from mlx_specdec.errors import UserError, run_guarded

DEFAULT_PROMPT = "Give three tips for staying focused while studying."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="default",
                   help="float16/bfloat16 model: 'default', a directory or a repo id (default: %(default)s)")
    p.add_argument("--output", "-o", default=None,
                   help="where to save the quantized model (default: next to the model cache)")
    p.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5, 6, 8], help="bits per weight (default: 4)")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="quantization group (default: 64)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt to run through both models")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate with each (default: 64)")
    p.add_argument("--compare", type=int, default=32, help="compare the first N greedy tokens (default: 32)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    p.add_argument("--dequantize", default="auto", choices=["auto", "on", "off"],
                   help="run the quantized model dequantized at load (the CPU's fast path; auto = on the CPU when "
                        "memory allows) or with MLX's quantized matmul (off) (default: auto)")


def size_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def count_weights(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.parameters()))


def _run(engine, prompt: str, max_tokens: int):
    from mlx_specdec.decoding import GenerationParams

    tokens: List[int] = []
    text, stats = "", None
    params = GenerationParams(max_tokens=max_tokens)
    for event in engine.generate(prompt, params=params):
        if event.kind == "token":
            tokens += event.tokens
            text += event.text
        elif event.kind == "done":
            stats = event.stats
    return tokens, text, stats


def run_quantize(args) -> int:
    from mlx_lm.convert import convert

    from mlx_specdec.engine import Engine
    from mlx_specdec.model.loader import check_weights, load_model, read_config, resolve_model_path

    source = resolve_model_path(args.model)
    config = read_config(source)
    check_weights(source)
    if config.get("quantization"):
        raise UserError(f"{source} is already quantized ({config['quantization'].get('bits')}-bit); "
                        "give a float16 model")
    out = Path(args.output).expanduser() if args.output else (
        source.parent / f"{source.name}-q{args.bits}g{args.group_size}")
    if out.exists():
        if not args.force:
            raise UserError(f"{out} exists; pass --force to overwrite or --output elsewhere")
        shutil.rmtree(out)
    print(f"Quantizing {source} -> {out} ({args.bits}-bit, group {args.group_size})...", file=sys.stderr)
    try:
        convert(str(source), str(out), quantize=True, q_bits=args.bits, q_group_size=args.group_size)
    except ValueError as exc:  # e.g. a layer width not divisible by the group size
        shutil.rmtree(out, ignore_errors=True)
        raise UserError(f"mlx-lm could not quantize {source}: {exc}") from None

    results = []
    for label, path in (("float", source), (f"{args.bits}-bit", out)):
        engine = Engine(load_model(str(path), dequantize=args.dequantize))
        if engine.lm.dequantized:
            label += ", dequantized at load"
        weights = count_weights(engine.lm.model)
        _run(engine, args.prompt, 4)  # warm-up, not timed
        tokens, text, stats = _run(engine, args.prompt, args.max_tokens)
        results.append((label, path, engine.lm, weights, tokens, text, stats))
        del engine

    float_weights = results[0][3]
    print(f"\nprompt: {args.prompt}\n")
    print("| model | dtype | size on disk (MB) | bits/weight | decode tok/s | tokens |")
    print("|---|---|---|---|---|---|")
    for label, path, lm, _, tokens, _, stats in results:
        size = size_on_disk(path) / 1e6
        bpw = size_on_disk(path) * 8 / float_weights
        print(f"| {label} | {lm.dtype} | {size:.1f} | {bpw:.2f} | {stats.decode_tps:.1f} | {len(tokens)} |")
    a, b = results[0][4][: args.compare], results[1][4][: args.compare]
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"\nfirst {args.compare} greedy tokens: {agree} agree before the first difference"
          f" ({'identical' if a == b else 'different'})")
    for label, _, _, _, _, text, _ in results:
        print(f"\n[{label}] {text.strip()[:300]}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantize.run", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_guarded(run_quantize, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
