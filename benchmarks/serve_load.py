"""A bounded load test of `mlx-specdec serve` on localhost: C clients x R streamed requests.

    python benchmarks/serve_load.py [--clients 16] [--requests 4] [--max-tokens 32] [--methods ar,redrafter]
                                    [--max-batch 1,8]

Per --max-batch value, starts the server on a free localhost port (the default model, `serve
--max-batch N`: at most N waiting redrafter requests decoded together), then per method: every client
sends its requests one after another with the `openai` client, streaming; checks that every
answer is complete (its usage says max_tokens or it ended at a stop) and equals the answer that
prompt gets alone (no crossed streams); reports requests/s, tokens/s and the p50/p95 time to the
first token, and the mean batch a request was decoded in. `ar` does not batch: it runs at the
first --max-batch value only. Everything is bounded: a fixed number of requests, a timeout on each.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

QUESTIONS = ["Give three tips for sleeping well.", "What is a prime number?", "Name four planets.",
             "How do I boil an egg?", "Why is the sea salty?", "What does a compiler do?",
             "Give two uses of vinegar.", "What is photosynthesis?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--methods", default="ar,redrafter")
    parser.add_argument("--max-batch", default="1,8", help="serve --max-batch values, comma-separated")
    args = parser.parse_args()
    print(f"{args.clients} clients x {args.requests} streamed requests, {args.max_tokens} tokens each\n")
    print("| method | max batch | requests | requests/s | tokens/s | TTFT p50 ms | TTFT p95 ms | mean batch | complete and own |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, max_batch in enumerate(int(b) for b in args.max_batch.split(",")):
        methods = [m for m in args.methods.split(",") if i == 0 or m == "redrafter"]
        run_server(args, max_batch, methods)


def run_server(args, max_batch: int, methods) -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlx_specdec.cli", "serve", "--port", str(port),
                               "--max-batch", str(max_batch)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)
        model = c.models.list().data[0].id
        for method in methods:
            alone = {q: c.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                                  max_tokens=args.max_tokens, extra_body={"method": method})
                     .choices[0].message.content for q in QUESTIONS}

            def ask(client_index: int):
                rows = []
                for r in range(args.requests):
                    q = QUESTIONS[(client_index + r) % len(QUESTIONS)]
                    begin = time.perf_counter()
                    first, text, usage, batch = None, [], None, 1
                    stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                                       max_tokens=args.max_tokens, stream=True,
                                                       stream_options={"include_usage": True},
                                                       extra_body={"method": method})
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            first = first or time.perf_counter() - begin
                            text.append(chunk.choices[0].delta.content)
                        if chunk.usage:
                            usage = chunk.usage
                        batch = (chunk.model_extra.get("speculation") or {}).get("batch_size", batch)
                    rows.append((q, "".join(text), first or 0.0, usage.completion_tokens if usage else 0, batch))
                return rows

            begin = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                results = [row for rows in pool.map(ask, range(args.clients), timeout=3600) for row in rows]
            wall = time.perf_counter() - begin
            ttft = sorted(r[2] * 1000 for r in results)
            good = all(r[1] == alone[r[0]] for r in results)
            tokens = sum(r[3] for r in results)
            print(f"| {method} | {max_batch} | {len(results)} | {len(results) / wall:.2f} | {tokens / wall:.1f} | "
                  f"{statistics.median(ttft):.0f} | {ttft[int(0.95 * (len(ttft) - 1))]:.0f} | "
                  f"{statistics.mean(r[4] for r in results):.1f} | {good} |", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
