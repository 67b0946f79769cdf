"""`mlx-specdec generate`: stream an answer to one prompt, then a stats line."""

from __future__ import annotations

import sys

from ..errors import UserError
from .args import _add_method_args, _add_model_args, _add_sampling_args, _params, load_engine
from .printer import print_answer


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream an answer to one prompt, then a stats line",
                       description="Stream an answer to one prompt; a stats line goes to stderr.")
    _add_model_args(p)
    p.add_argument("--prompt", "-p", required=True, help="the prompt ('-' reads stdin)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_sampling_args(p)
    _add_method_args(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from ..engine import check_method

    check_method(args.method)
    params = _params(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise UserError("empty prompt")
    engine = load_engine(args)
    events = engine.generate(prompt, method=args.method, params=params, chat_template=not args.raw)
    print_answer(engine, events, verbose=True, method=args.method)
    return 0
