"""`mlx-specdec serve`: an OpenAI-compatible HTTP server over one model (mlx_specdec/serve/)."""

from __future__ import annotations

import os
import signal
import sys

from ..errors import UserError
from .args import DRAFTER_HELP, METHODS_HELP, _add_model_args, load_engine


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with every method",
                       description="Serve one model over the OpenAI API (POST /v1/chat/completions, "
                                   "/v1/completions; GET /v1/models, /health). Point any OpenAI client at "
                                   "http://HOST:PORT/v1. A request may pick its own method with the extra "
                                   "field `method`.")
    _add_model_args(p)
    p.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
    p.add_argument("--method", default="auto", help=f"the default method: {METHODS_HELP}; auto = per request, "
                   "the one measured (or predicted) fastest here (default: auto)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 requests (default: none)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="at most this many waiting requests decoded together where the method batches "
                        "(redrafter; 1 = one request at a time; default: 8)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from ..engine import check_method

    check_method(args.method)
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be 1-65535, not {args.port}")
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be at least 1, not {args.max_batch}")
    try:
        import uvicorn

        from ..serve.app import create_app
        from ..serve.worker import GenerationWorker
    except ImportError as exc:
        raise UserError(f"serve needs starlette and uvicorn ({exc.name} is missing): pip install starlette uvicorn")
    _check_port_free(args.host, args.port)  # before the model loads, not after
    # the engine loads on the generation thread, which makes every MLX call (serve/worker.py)
    worker = GenerationWorker(lambda: load_engine(args, reuse_prefix=True), max_batch=args.max_batch)
    app = create_app(worker, method=args.method, api_key=args.api_key, model_spec=args.model)
    print(f"serving {worker.engine.lm.name} ({args.method}) on http://{args.host}:{args.port}/v1 (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    server = _server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"), worker)
    # uvicorn handles SIGINT and SIGTERM alike (answers end at their next token, connections close),
    # then raises the signal again under the handler it found: make that Ctrl-C's for both.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the signal it caught again once it has shut down
        pass
    worker.stop()
    worker.join(timeout=10)
    print("stopped", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Leave without the interpreter's teardown: MLX streams of the ended generation thread abort
    # the process at exit (ml-explore/mlx#3126, as the chat app).
    os._exit(0)


def _check_port_free(host: str, port: int) -> None:
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: {exc.strerror}")
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise UserError(f"cannot listen on {host} port {port}: {exc.strerror} "
                            "(another server there? pick another --port)")


def _server(config, worker):
    import uvicorn

    class Server(uvicorn.Server):
        """Ctrl-C (or SIGTERM) stops every request at its next token, then uvicorn's own graceful
        shutdown closes the connections: no wait for a long answer to finish."""

        def __init__(self, config, worker):
            super().__init__(config)
            self.worker = worker

        def handle_exit(self, sig, frame):
            self.worker.cancel_all()
            super().handle_exit(sig, frame)

    return Server(config, worker)
