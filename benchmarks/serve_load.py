"""A bounded load test of `mlx-specdec serve` against `mlx_lm.server` on localhost, same weights.

    python benchmarks/serve_load.py [--clients 1,16,64] [--requests 2] [--max-tokens 32]
                                    [--methods ar,redrafter] [--max-batch 32] [--servers ours,mlx-lm]
                                    [--repeats 3] [--json results.json]

Each server is started on a free localhost port with the default model: ours (`serve --max-batch
N`), and mlx-lm's own server (`--decode-concurrency N`) on a float32 copy of the same weights
(ours computes in float32 on the CPU) with the same BLAS (the engine's OpenBLAS and small-row
GEMM are loaded into its process first). Per server, method and client count, every client sends
its requests one after another with the `openai` client, streaming, greedy; every answer must be
complete (max_tokens or a stop) and equal the answer that prompt gets alone from the same server
(no crossed streams). Reports requests/s, generated tokens/s and p50/p95 time to the first token.
With --repeats N every configuration runs N times (the repeats of one server and method take turns
over the client counts, so a slow spell of the machine spreads over them) and each figure is the
median of the repeats with their min-max. `method` goes to our server as the request body's
extension field (`extra_body`); mlx-lm's server gets none. Everything is bounded: a fixed number
of requests, a timeout on each.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

QUESTIONS = ["Give three tips for sleeping well.", "What is a prime number?", "Name four planets.",
             "How do I boil an egg?", "Why is the sea salty?", "What does a compiler do?",
             "Give two uses of vinegar.", "What is photosynthesis?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def float32_copy(directory: Path) -> Path:
    """The model directory with its weights in float32 (what our engine computes in on the CPU)."""
    import mlx.core as mx

    out = Path(tempfile.mkdtemp(prefix="serve-load-f32-"))
    for f in directory.iterdir():
        if f.suffix == ".safetensors":
            mx.save_safetensors(str(out / f.name), {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating)
                                                    else v for k, v in mx.load(str(f)).items()})
        elif f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    return out


def start(server: str, port: int, max_batch: int, model_dir: Path, log=None) -> subprocess.Popen:
    """The server on localhost:port, once /health answers; log: a file for its output (else none)."""
    if server == "ours":
        argv = [sys.executable, "-m", "mlx_specdec.cli", "serve", "--port", str(port), "--max-batch", str(max_batch)]
    else:  # the engine's BLAS first (importing mlx_specdec loads it), then mlx-lm's server as its own CLI
        code = ("import sys, runpy, mlx_specdec; sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                "runpy.run_module('mlx_lm.server', run_name='__main__')")
        argv = [sys.executable, "-c", code, "--model", str(model_dir), "--port", str(port),
                "--decode-concurrency", str(max_batch), "--log-level", "WARNING"]
    output = log if log is not None else subprocess.DEVNULL
    process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT if log is not None else output)
    for _ in range(480):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process
        except OSError:
            if process.poll() is not None:
                raise SystemExit(f"{server} server exited with {process.returncode}")
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{server} server did not start")


def percentile(values, q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it (with two
    values, p95 is the larger one, not the smaller)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def measure(c, model: str, method: str, clients: int, args, alone: dict) -> dict:
    extra = {"method": method} if method != "mlx-lm" else {}

    def ask(client_index: int):
        rows = []
        for r in range(args.requests):
            q = QUESTIONS[(client_index + r) % len(QUESTIONS)]
            begin = time.perf_counter()
            first, text, usage = None, [], None
            stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                               max_tokens=args.max_tokens, temperature=0.0, stream=True,
                                               stream_options={"include_usage": True}, extra_body=extra)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter() - begin
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage:
                    usage = chunk.usage
            rows.append((q, "".join(text), first or 0.0, usage.completion_tokens if usage else 0))
        return rows

    begin = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [row for rows in pool.map(ask, range(clients), timeout=3600) for row in rows]
    wall = time.perf_counter() - begin
    ttft = [r[2] * 1000 for r in results]
    return dict(requests=len(results), rps=len(results) / wall, tps=sum(r[3] for r in results) / wall,
                p50=statistics.median(ttft), p95=percentile(ttft, 0.95), wall_s=wall,
                own=all(r[1] == alone[r[0]] for r in results) and all(r[3] > 0 for r in results))


def spread(runs, key: str, digits: int) -> str:
    """The median of the repeats, with their min-max when there are several."""
    values = [r[key] for r in runs]
    middle = f"{statistics.median(values):.{digits}f}"
    return middle if len(values) == 1 else f"{middle} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,16,64", help="concurrent clients, comma-separated")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--methods", default="ar,redrafter", help="our methods")
    parser.add_argument("--max-batch", type=int, default=32, help="ours: --max-batch; mlx-lm: --decode-concurrency")
    parser.add_argument("--servers", default="ours,mlx-lm")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (median, min-max)")
    parser.add_argument("--json", default=None, help="write every run's figures here")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    from mlx_specdec.model.default import ensure_default_model

    model_dir = Path(ensure_default_model())
    f32 = float32_copy(model_dir) if "mlx-lm" in args.servers else None
    counts = [int(n) for n in args.clients.split(",")]
    print(f"{args.requests} streamed greedy requests per client, {args.max_tokens} tokens each, "
          f"max batch {args.max_batch}, {args.repeats} run(s) each" +
          (" (median, min-max)" if args.repeats > 1 else "") + "\n")
    print("| server | method | clients | requests | requests/s | tokens/s | TTFT p50 ms | TTFT p95 ms | complete and own |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    try:
        for server in args.servers.split(","):
            port = free_port()
            process = start(server, port, args.max_batch, f32 or model_dir)
            try:
                c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)
                model = c.models.list().data[0].id if server == "ours" else "default_model"
                for method in (args.methods.split(",") if server == "ours" else ["mlx-lm"]):
                    extra = {"method": method} if server == "ours" else {}
                    alone = {q: c.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": q}], max_tokens=args.max_tokens,
                        temperature=0.0, extra_body=extra).choices[0].message.content for q in QUESTIONS}
                    runs = {n: [] for n in counts}
                    for repeat in range(args.repeats):
                        for clients in counts:
                            m = measure(c, model, method, clients, args, alone)
                            runs[clients].append(m)
                            print(f"  run {repeat + 1}/{args.repeats}: {server} {method} {clients} clients: "
                                  f"{m['rps']:.2f} requests/s, {m['tps']:.1f} tokens/s, TTFT p50 {m['p50']:.0f} ms, "
                                  f"p95 {m['p95']:.0f} ms, complete and own {m['own']}", file=sys.stderr, flush=True)
                    for clients in counts:
                        r = runs[clients]
                        print(f"| {server} | {method} | {clients} | {r[0]['requests']} | {spread(r, 'rps', 2)} | "
                              f"{spread(r, 'tps', 1)} | {spread(r, 'p50', 0)} | {spread(r, 'p95', 0)} | "
                              f"{all(m['own'] for m in r)} |", flush=True)
                        rows.append(dict(server=server, method=method, clients=clients, runs=r))
            finally:
                process.terminate()
                process.wait(timeout=30)
    finally:
        if f32 is not None:
            shutil.rmtree(f32, ignore_errors=True)
        if args.json:
            settings = {k: v for k, v in vars(args).items() if k != "json"}
            Path(args.json).write_text(json.dumps(dict(settings=settings, rows=rows), indent=1) + "\n")
    if not all(m["own"] for row in rows for m in row["runs"]):
        raise SystemExit("an answer was incomplete or not its own")


if __name__ == "__main__":
    main()
