"""`mlx-specdec serve`: an OpenAI-compatible HTTP server over one model (mlx_specdec/serve/)."""

from __future__ import annotations

import os
import signal
import sys

from ..cache.prefix import DEFAULT_MAX_ENTRIES, PrefixStore, machine_memory
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
                   help="at most this many requests decoded together as rows of one batch (ar and redrafter "
                        "requests join a running batch at its next step; 1 = one request at a time; default: 8)")
    p.add_argument("--max-batch-bytes", type=_size, default=None, metavar="BYTES",
                   help="KV cache bytes a batch may hold; a request that would take it past waits for rows to "
                        "leave (e.g. 4G; default: a quarter of this machine's memory)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=None, metavar="BYTES",
                   help="KV cache bytes kept for resuming conversations (an LRU over several; e.g. 512M, 2G; "
                        "0 = off; default: 2G, or an eighth of this machine's memory where that is less)")
    p.add_argument("--prompt-cache-entries", type=int, default=DEFAULT_MAX_ENTRIES, metavar="N",
                   help=f"conversations the prompt cache keeps (0 = off; default: {DEFAULT_MAX_ENTRIES})")
    p.set_defaults(func=cmd_serve)


def _size(text: str) -> int:
    """Bytes from '1073741824', '512M', '2G', '1.5GB' (binary units)."""
    import argparse

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = units.get(value[-1:], 1)
    try:
        number = float(value[:-1] if unit > 1 else value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a number of bytes, or with K, M, G: 512M, 2G)")
    if not number >= 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (at least 0)")
    return int(number * unit)


def cmd_serve(args) -> int:
    from ..engine import check_method

    check_method(args.method)
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be 1-65535, not {args.port}")
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be at least 1, not {args.max_batch}")
    if args.prompt_cache_entries < 0:
        raise UserError(f"--prompt-cache-entries must be at least 0, not {args.prompt_cache_entries}")
    store = PrefixStore(args.prompt_cache_bytes, args.prompt_cache_entries)
    prompt_cache = store if store.max_bytes > 0 and store.max_entries > 0 else False  # False: no cache
    try:
        import uvicorn

        from ..serve.app import create_app
        from ..serve.worker import GenerationWorker
    except ImportError as exc:
        raise UserError(f"serve needs starlette and uvicorn ({exc.name} is missing): pip install starlette uvicorn")
    _check_port_free(args.host, args.port)  # before the model loads, not after
    # the engine loads on the generation thread, which makes every MLX call (serve/worker.py)
    batch_bytes = args.max_batch_bytes if args.max_batch_bytes is not None else machine_memory() // 4
    if batch_bytes <= 0:
        raise UserError(f"--max-batch-bytes must be more than 0, not {args.max_batch_bytes}")
    worker = GenerationWorker(lambda: _warmed(load_engine(args, reuse_prefix=prompt_cache), args.method),
                              max_batch=args.max_batch, max_batch_bytes=batch_bytes)
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


def _warmed(engine, method: str):
    """The served method readied at the model's default sampling before the first request
    (engine_measured.py): the first answer runs as fast as the later ones."""
    from ..decoding import GenerationParams
    from ..sampling_defaults import fill

    params = GenerationParams(**fill({}, engine.sampling_defaults[0], method))
    try:
        seconds = engine.warm_up(method, params, lambda stage: print(f"{stage} ...", file=sys.stderr, flush=True))
    except Exception as error:  # noqa: BLE001 - the first request pays its own warm-up, nothing worse
        print(f"warning: warm-up failed ({error}); the first answer warms up instead", file=sys.stderr)
    else:
        print(f"warmed up in {seconds:.1f} s", file=sys.stderr, flush=True)
    return engine


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
