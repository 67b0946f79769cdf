"""A bounded load test of `mlx-specdec serve` against `mlx_lm.server` on localhost, same weights.

    python benchmarks/serve_load.py [--clients 1,16,64] [--requests 2] [--max-tokens 32]
                                    [--methods ar,redrafter] [--max-batch 32] [--servers ours,mlx-lm]

Each server is started on a free localhost port with the default model: ours (`serve --max-batch
N`), and mlx-lm's own server (`--decode-concurrency N`) on a float32 copy of the same weights
(ours computes in float32 on the CPU) with the same BLAS (the engine's OpenBLAS and small-row
GEMM are loaded into its process first). Per server, method and client count, every client sends
its requests one after another with the `openai` client, streaming, greedy; every answer must be
complete (max_tokens or a stop) and equal the answer that prompt gets alone from the same server
(no crossed streams). Reports requests/s, generated tokens/s and p50/p95 time to the first token.
Everything is bounded: a fixed number of requests, a timeout on each.
"""

from __future__ import annotations

import argparse
import json
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


def start(server: str, port: int, max_batch: int, model_dir: Path) -> subprocess.Popen:
    if server == "ours":
        argv = [sys.executable, "-m", "mlx_specdec.cli", "serve", "--port", str(port), "--max-batch", str(max_batch)]
    else:  # the engine's BLAS first (importing mlx_specdec loads it), then mlx-lm's server as its own CLI
        code = ("import sys, runpy, mlx_specdec; sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                "runpy.run_module('mlx_lm.server', run_name='__main__')")
        argv = [sys.executable, "-c", code, "--model", str(model_dir), "--port", str(port),
                "--decode-concurrency", str(max_batch), "--log-level", "WARNING"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    ttft = sorted(r[2] * 1000 for r in results)
    return dict(requests=len(results), rps=len(results) / wall, tps=sum(r[3] for r in results) / wall,
                p50=statistics.median(ttft), p95=ttft[int(0.95 * (len(ttft) - 1))],
                own=all(r[1] == alone[r[0]] for r in results) and all(r[3] > 0 for r in results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,16,64", help="concurrent clients, comma-separated")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--methods", default="ar,redrafter", help="our methods")
    parser.add_argument("--max-batch", type=int, default=32, help="ours: --max-batch; mlx-lm: --decode-concurrency")
    parser.add_argument("--servers", default="ours,mlx-lm")
    args = parser.parse_args()
    from mlx_specdec.model.default import ensure_default_model

    model_dir = Path(ensure_default_model())
    f32 = float32_copy(model_dir) if "mlx-lm" in args.servers else None
    print(f"{args.requests} streamed greedy requests per client, {args.max_tokens} tokens each, "
          f"max batch {args.max_batch}\n")
    print("| server | method | clients | requests | requests/s | tokens/s | TTFT p50 ms | TTFT p95 ms | complete and own |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
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
                    for clients in (int(n) for n in args.clients.split(",")):
                        m = measure(c, model, method, clients, args, alone)
                        print(f"| {server} | {method} | {clients} | {m['requests']} | {m['rps']:.2f} | {m['tps']:.1f} | "
                              f"{m['p50']:.0f} | {m['p95']:.0f} | {m['own']} |", flush=True)
            finally:
                process.terminate()
                process.wait(timeout=30)
    finally:
        if f32 is not None:
            shutil.rmtree(f32, ignore_errors=True)


if __name__ == "__main__":
    main()
