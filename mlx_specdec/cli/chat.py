"""`mlx-specdec chat`: the full-screen app (`tui/`), or `--plain` for a line-by-line chat."""

from __future__ import annotations

import sys
from typing import List

from ..errors import UserError
from .args import _add_method_args, _add_model_args, _add_sampling_args, _params, load_engine
from .printer import AnswerPrinter


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat in the terminal (full-screen app; --plain for a REPL)",
                       description="Chat in the terminal: a full-screen app with saved conversations, "
                                   "per-conversation methods, live thread panes and a speed status bar. "
                                   "--plain gives a line-by-line chat.")
    _add_model_args(p)
    _add_sampling_args(p, max_tokens=512, method="auto")
    _add_method_args(p)
    p.add_argument("--plain", action="store_true",
                   help="a plain line-by-line chat instead of the full-screen app (works in pipes)")
    p.add_argument("--verbose", "-v", action="store_true", help="--plain: print a stats line after each answer")
    p.add_argument("--db", default=None,
                   help="app: conversation database (default: chats.sqlite3 in the user data directory, "
                        "or $MLX_SPECDEC_DATA)")
    p.add_argument("--export-dir", default=None,
                   help="app: where Ctrl+S writes Markdown exports (default: exports/ in the user data directory)")
    p.add_argument("--light", action="store_true", help="app: start with the light theme (Ctrl+T toggles)")
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    """The Textual chat app (`tui/`); `--plain` keeps the line-by-line terminal chat."""
    from ..engine import check_method
    from ..penalties import check_method as check_penalties
    from ..sampling_defaults import describe, model_defaults, spec_directory

    check_method(args.method)
    check_penalties(args.method, _params(args))  # an explicit penalty the method cannot apply
    if not args.plain:
        from tui.cli import run_chat  # the app lives outside the engine: nothing here imports Textual

        # the model's defaults as new conversations' settings, read before the app loads the model
        return run_chat(args, _params(args, model_defaults(spec_directory(args.model))[0], args.method))
    engine = load_engine(args, reuse_prefix=True)  # each turn resumes from the last one's prompt
    defaults, source = engine.sampling_defaults
    params = _params(args, defaults, args.method)
    print(f"Chatting with {engine.lm.describe()} using {args.method}; {describe(params, source)}. "
          "Type /quit to leave, /reset to start over; Ctrl-C stops an answer.", file=sys.stderr)
    messages: List[dict] = []
    while True:
        try:
            question = input("\n>>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        question = question.strip()
        if not question:
            continue
        if question in ("/quit", "/exit"):
            return 0
        if question == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": question})
        printer = AnswerPrinter(engine.lm.tokenizer, args.verbose, restore=args.method == "apar")
        try:
            for event in engine.chat(messages, method=args.method, params=params):
                printer.feed(event)
        except KeyboardInterrupt:
            printer.finish()  # APAR: the unfinished threads' text too
            print("[stopped]", file=sys.stderr)
        except UserError as exc:  # e.g. the conversation outgrew the context window
            print(f"\nerror: {exc}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": printer.text})
