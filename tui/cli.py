"""`mlx-specdec chat`: start the Textual app (the CLI imports this lazily; the engine never does)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mlx_specdec.engine import apar_adapter_spec
from mlx_specdec.errors import UserError


def run_chat(args, params) -> int:
    """args: the `chat` subcommand's namespace; params: its GenerationParams (new conversations'
    defaults). Returns the exit status."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UserError("the chat app needs a terminal; use `mlx-specdec chat --plain` for a pipe")
    from .app import ChatApp, real_loader

    from mlx_specdec.settings import SAMPLING

    settings = {**{s.name: getattr(params, s.name) for s in SAMPLING}, **params.options}
    settings.pop("profile", None)
    adapter = apar_adapter_spec(getattr(args, "apar_adapter", "auto"))
    app = ChatApp(loader=real_loader(args.model, args.dtype, args.drafter, adapter, getattr(args, "draft_model", None)),
                  db_path=Path(args.db).expanduser() if args.db else None,
                  method=args.method, settings=settings, model_label=args.model,
                  export_dir=Path(args.export_dir).expanduser() if args.export_dir else None,
                  theme="textual-light" if args.light else "textual-dark")
    app.run()
    code = app.return_code or 0
    # Leave now, past the interpreter's teardown: MLX streams that ended thread workers created can
    # abort the process as it exits ("terminate called without an active exception", status 134;
    # ml-explore/mlx#3126; seen here in about 1 exit in 3 after a generation). Nothing is lost:
    # the conversation store commits as it writes, and Textual has restored the terminal.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
