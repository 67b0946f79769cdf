"""`mlx-specdec`: generate, chat, serve, bench, calibrate, train-drafter, import-drafter, convert, quantize, fetch.

Errors a user can cause end in one line on stderr and exit status 1 (a setting the chosen method
cannot apply: 2, as argparse's usage errors); Ctrl-C exits 130.

One module per command or group of commands; each has `add_parser(sub)`, which registers its
subcommands, their options and `func`. `--help` lists them in the order of COMMANDS.
"""

from __future__ import annotations

import argparse
from typing import List, Optional

import mlx_specdec  # noqa: F401  (preloads BLAS before any mlx import)

from ..errors import run_guarded
from . import bench, calibrate, chat, generate, import_drafter, models, serve, train

#: generate, chat, serve, bench, calibrate, train-drafter, train-apar, train-fork-probe, import-drafter,
#: convert, fetch, quantize
COMMANDS = (generate, chat, serve, bench, calibrate, train, import_drafter, models)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-specdec",
        description="Fast, lossless LLM decoding on MLX (ReDrafter, APAR, TriForce, PipeInfer).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(args.func, args)
