"""`mlx-specdec generate`: stream an answer to one prompt, then a stats line."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UserError
from .args import _add_method_args, _add_model_args, _add_sampling_args, _params, load_engine
from .pipeline import PIPELINE_METHODS, add_pipeline_args, generate_pipelined
from .printer import print_answer


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream an answer to one prompt, then a stats line",
                       description="Stream an answer to one prompt; a stats line goes to stderr.")
    _add_model_args(p)
    p.add_argument("--prompt", "-p", default=None, help="the prompt ('-' reads stdin); with --document, the question")
    p.add_argument("--prompt-file", default=None, metavar="FILE", help="read the whole prompt from a UTF-8 text file")
    p.add_argument("--document", default=None, metavar="FILE",
                   help="a UTF-8 text file to ask about: the prompt is the document, a blank line, then --prompt "
                        "(a document past the model's context window is refused, not cut)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_sampling_args(p)
    _add_method_args(p)
    add_pipeline_args(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from ..engine import check_method
    from ..penalties import OFF
    from ..penalties import check_method as check_penalties
    from ..sampling_defaults import describe, model_defaults, spec_directory

    pipelined = args.method in PIPELINE_METHODS or args.ranks is not None or args.hostfile is not None
    if not pipelined:
        check_method(args.method)
    elif args.method not in PIPELINE_METHODS + ("ar",):
        raise UserError(f"--ranks runs {', '.join(PIPELINE_METHODS)}, not {args.method!r}")
    method = (args.method if args.method in PIPELINE_METHODS else "pipeinfer") if pipelined else args.method
    check_penalties(method, _params(args))  # an explicit penalty the method cannot apply, before any load
    prompt = _prompt(args)
    if not prompt.strip():
        raise UserError("empty prompt")
    if pipelined:
        defaults, source = model_defaults(spec_directory(args.model))
        params = _params(args, defaults, method)
        print(describe(params, source), file=sys.stderr)
        args.temp, args.top_p, args.seed = params.temperature, params.top_p, args.seed or 0
        args.penalties = {name: getattr(params, name) for name in (*OFF, "repetition_context_size")}
        return generate_pipelined(args, prompt)
    engine = load_engine(args)
    defaults, source = engine.sampling_defaults
    params = _params(args, defaults, method)
    print(describe(params, source), file=sys.stderr)
    events = engine.generate(prompt, method=args.method, params=params, chat_template=not args.raw)
    print_answer(engine, events, verbose=True, method=args.method)
    return 0


def _read_text(path: str, flag: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{flag}: no such file {file}")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{flag}: {file} is not UTF-8 text") from None


def _prompt(args) -> str:
    """-p, --prompt-file, or --document with -p as the question (exactly one way in)."""
    if args.prompt_file and (args.prompt is not None or args.document):
        raise UserError("--prompt-file is the whole prompt: use it without --prompt and --document")
    if args.prompt_file:
        return _read_text(args.prompt_file, "--prompt-file")
    if args.prompt is None:
        raise UserError("give a prompt: --prompt TEXT, --prompt-file FILE, or --document FILE with --prompt")
    question = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.document:
        return _read_text(args.document, "--document").rstrip() + "\n\n" + question
    return question
