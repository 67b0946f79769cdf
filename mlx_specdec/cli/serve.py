"""`mlx-specdec serve`: an OpenAI-compatible HTTP server over one model (mlx_specdec/serve/)."""

from __future__ import annotations

import sys

from ..errors import UserError
from .args import METHODS_HELP, _add_model_args, load_engine


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with every method",
                       description="Serve one model over the OpenAI API (POST /v1/chat/completions, "
                                   "/v1/completions; GET /v1/models, /health). Point any OpenAI client at "
                                   "http://HOST:PORT/v1. A request may pick its own method with the extra "
                                   "field `method`.")
    _add_model_args(p)
    p.add_argument("--drafter", default="auto",
                   help="ReDrafter head directory ('auto' = the one shipped for this model, 'none' = no head)")
    p.add_argument("--method", default="ar", help=f"the default method: {METHODS_HELP} (default: ar)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 requests (default: none)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from ..engine import check_method

    check_method(args.method)
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be 1-65535, not {args.port}")
    try:
        import uvicorn

        from ..serve.app import create_app
        from ..serve.worker import GenerationWorker
    except ImportError as exc:
        raise UserError(f"serve needs starlette and uvicorn ({exc.name} is missing): pip install starlette uvicorn")
    if args.drafter == "none":
        args.drafter = None
    # the engine loads on the generation thread, which makes every MLX call (serve/worker.py)
    worker = GenerationWorker(lambda: load_engine(args, reuse_prefix=True))
    app = create_app(worker, method=args.method, api_key=args.api_key)
    print(f"serving {worker.engine.lm.name} ({args.method}) on http://{args.host}:{args.port}/v1 (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
