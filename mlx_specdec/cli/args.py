"""Arguments several commands share (model, method, sampling), their checks, and loading the engine."""

from __future__ import annotations

import argparse
import sys
from typing import List

from ..errors import UserError

MODEL_HELP = ("model: 'default' (embedded SmolLM2-135M-Instruct), 'default-4bit', a local model "
              "directory, a .gguf file, or a Hugging Face repo id (default: %(default)s)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="default", help=MODEL_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="compute dtype; auto = float32 on the CPU, the model's own on Metal")
    p.add_argument("--apar-adapter", default="auto",
                   help="apar: adapter directory (made by train-apar); 'auto' = the one shipped in models/ "
                        "for this model; 'none' = no adapter (default: auto)")


METHODS_HELP = "ar (plain), mlx-lm (peer baseline), redrafter, apar"


def _add_method_args(p: argparse.ArgumentParser, lists: bool = False) -> None:
    """Method settings; in `bench` they take comma lists and every combination runs."""
    kind = "comma list of " if lists else ""
    p.add_argument("--drafter", default="auto",
                   help="ReDrafter head directory; 'auto' = the head shipped in models/ for this model")
    p.add_argument("--beam-width", default=None,
                   help=f"redrafter: {kind}beam width W (default: 2)")
    p.add_argument("--beam-length", default=None,
                   help=f"redrafter: {kind}beam length L, the LLM's token + L-1 drafts (default: 5)")
    p.add_argument("--profile", action="store_true",
                   help="redrafter: sync after each phase to report draft/verify/accept time (slower)")
    p.add_argument("--max-threads", default=None,
                   help=f"apar: {kind}most live threads per answer (default: 32)")
    p.add_argument("--max-depth", default=None,
                   help=f"apar: {kind}deepest fork, 0 = never fork (default: 2)")
    p.add_argument("--fork-probe", default=None,
                   help=f"apar: {kind}on = the original model writes until the first fork, decided by the "
                        "adapter's fork probe (an unforked answer is the original's); off = the adapted "
                        "model writes everything (default: on where the adapter ships a probe)")


def _method_options(args) -> dict:
    options = {}
    if args.beam_width is not None:
        options["beam_width"] = _positive_int(args.beam_width, "--beam-width")
    if args.beam_length is not None:
        options["beam_length"] = _positive_int(args.beam_length, "--beam-length")
    if args.profile:
        options["profile"] = True
    if args.max_threads is not None:
        options["max_threads"] = _positive_int(args.max_threads, "--max-threads")
    if args.max_depth is not None:
        options["max_depth"] = _nonnegative_int(args.max_depth, "--max-depth")
    if args.fork_probe is not None:
        options["fork_probe"] = _on_off(args.fork_probe, "--fork-probe")
    return options


def _on_off(value: str, flag: str) -> bool:
    if value.strip().lower() not in ("on", "off"):
        raise UserError(f"{flag} is on or off, not {value!r}")
    return value.strip().lower() == "on"


def _whole_number(text: str, flag: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{flag} takes a whole number, not {text!r}") from None
    if value < minimum:
        raise UserError(f"{flag} must be at least {minimum}")
    return value


def _nonnegative_int(text: str, flag: str) -> int:
    return _whole_number(text, flag, 0)


def _positive_int(text: str, flag: str) -> int:
    return _whole_number(text, flag, 1)


def _comma_list(text: str, kind=str) -> List:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"bad comma list {text!r}") from None


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    p.add_argument("--method", default="ar", help=f"decoding method: {METHODS_HELP} (default: ar)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args):
    from ..decoding import GenerationParams

    if args.max_tokens <= 0:
        raise UserError("--max-tokens must be positive")
    if args.temp < 0:
        raise UserError("--temp must be >= 0")
    return GenerationParams(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                            seed=args.seed, stop=tuple(args.stop), options=_method_options(args))


def load_engine(args):
    from ..engine import Engine, apar_adapter_spec

    print(f"Loading {args.model}...", file=sys.stderr, flush=True)
    return Engine.load(args.model, dtype=args.dtype, drafter=getattr(args, "drafter", "auto"),
                       apar_adapter=apar_adapter_spec(getattr(args, "apar_adapter", "auto")))
