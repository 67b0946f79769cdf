"""A short request arriving while a batch of long ones decodes: what it waits for, per method.

    python benchmarks/serve_midbatch.py [--methods ar,redrafter] [--batch 6] [--long-tokens 256]
                                        [--after 3] [--short-tokens 32] [--repeats 1] [--json out.json]

Our server (`serve --max-batch`, at least the batch plus one) on a free localhost port with the
default model. Per method and repeat: `--batch` long requests (streamed, greedy, `--long-tokens`
each) are sent together; `--after` seconds later one short request (streamed, greedy,
`--short-tokens`) is sent. Reported: the short request's time to its first token and its total
time, and the batch's remaining time when it arrived (from its arrival until the last long
request finished) -- a short request that joins the running batch finishes well inside that time,
one that waits for the batch to drain does not start before it ends. The short answer must equal
what the same prompt gets alone (sent after the mid-batch runs, so the mid-batch request does not
resume from a prompt cache the reference filled; the JSON's short_cached says how many prompt
tokens it did resume, the chat template's shared start among them); each run, of every method,
asks a different short question. Everything is bounded: a timeout on each request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import openai

from serve_load import QUESTIONS, free_port, spread, start

# prompts that draw long answers from a small instruct model, so the batch is still decoding when
# the short request arrives (their completion tokens are reported: one that stops early shortens it)
LONG_PROMPTS = ["Write a long, detailed story about a lighthouse keeper and a storm.",
                "Explain in detail how a car engine works, step by step.",
                "Write a long essay about the history of the printing press.",
                "Describe in detail a journey across a desert, day by day.",
                "Write a detailed guide to growing vegetables in a small garden.",
                "Explain at length how the internet carries a message from one computer to another.",
                "Write a long story about two friends who build a boat.",
                "Describe in detail the life cycle of a star."]


def stream(c, model: str, method: str, question: str, max_tokens: int, timeout: float) -> dict:
    """One streamed greedy chat request: its times (from its sending), text, tokens and finish."""
    begin = time.perf_counter()
    first, text, usage, finish = None, [], None, None
    chunks = c.with_options(timeout=timeout).chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, extra_body={"method": method})
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage
    end = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return dict(sent=begin, first=first or end, end=end, ttft_ms=((first or end) - begin) * 1000,
                total_ms=(end - begin) * 1000, text="".join(text), finish=finish,
                tokens=usage.completion_tokens if usage else 0,
                cached=(getattr(details, "cached_tokens", 0) or 0) if details else 0)


def once(c, model: str, method: str, args, repeat: int, short_index: int) -> dict:
    """`--batch` long requests, then after `--after` s one short one; times relative to the batch's start."""
    longs, errors = [None] * args.batch, []

    def long(i: int) -> None:
        try:
            question = LONG_PROMPTS[(i + repeat) % len(LONG_PROMPTS)]
            longs[i] = stream(c, model, method, question, args.long_tokens, args.timeout)
        except Exception as error:  # noqa: BLE001  (reported below; the run fails)
            errors.append(f"long request {i}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=long, args=(i,), daemon=True) for i in range(args.batch)]
    start_at = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(max(0.0, start_at + args.after - time.perf_counter()))
    question = QUESTIONS[short_index % len(QUESTIONS)]
    short = stream(c, model, method, question, args.short_tokens, args.timeout)
    for t in threads:
        t.join(args.timeout)
    if errors or any(r is None for r in longs):
        raise SystemExit(f"{method}: " + ("; ".join(errors) or "a long request did not finish in time"))
    last = max(r["end"] for r in longs)
    return dict(question=question, arrived_s=short["sent"] - start_at,
                running_at_arrival=sum(r["end"] > short["sent"] for r in longs),
                remaining_s=max(0.0, last - short["sent"]), short_ttft_ms=short["ttft_ms"],
                short_total_ms=short["total_ms"], short_tokens=short["tokens"], short_finish=short["finish"],
                short_cached=short["cached"], short_text=short["text"],
                finished_before_batch=short["end"] < last, batch_s=last - start_at,
                long_tokens=[r["tokens"] for r in longs], long_finish=[r["finish"] for r in longs],
                long_first_s=[round(r["first"] - start_at, 3) for r in longs],
                long_end_s=[round(r["end"] - start_at, 3) for r in longs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,redrafter")
    parser.add_argument("--batch", type=int, default=6, help="long requests sent together")
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--after", type=float, default=3.0, help="seconds after the batch the short request is sent")
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=None, help="the server's --max-batch (default: batch + 2)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one request may take")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from mlx_specdec.model.default import ensure_default_model

    max_batch = args.max_batch or args.batch + 2
    port = free_port()
    process = start("ours", port, max_batch, Path(ensure_default_model()))
    out = dict(settings=vars(args) | {"max_batch": max_batch}, methods={})
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=args.timeout, max_retries=0)
        model = c.models.list().data[0].id
        for index, method in enumerate(args.methods.split(",")):
            stream(c, model, method, LONG_PROMPTS[-1], 8, args.timeout)  # warm: the method's first use loads it
            runs = []
            for repeat in range(args.repeats):
                # a short question no earlier run or reference asked: its prompt is not in the cache
                run = once(c, model, method, args, repeat, index * args.repeats + repeat)
                runs.append(run)
                print(f"  {method} run {repeat + 1}/{args.repeats}: arrived at {run['arrived_s']:.2f} s with "
                      f"{run['running_at_arrival']} long running and {run['remaining_s']:.2f} s of the batch left; "
                      f"TTFT {run['short_ttft_ms']:.0f} ms, total {run['short_total_ms']:.0f} ms; long tokens "
                      f"{run['long_tokens']}, first tokens at {run['long_first_s']} s", file=sys.stderr, flush=True)
            # the references, after the mid-batch runs (the prompt cache holds these prompts from now on)
            alone = {q: stream(c, model, method, q, args.short_tokens, args.timeout) for q in {r["question"] for r in runs}}
            for run in runs:
                run["alone_ttft_ms"] = alone[run["question"]]["ttft_ms"]
                run["alone_total_ms"] = alone[run["question"]]["total_ms"]
                run["same_as_alone"] = run["short_text"] == alone[run["question"]]["text"]
            out["methods"][method] = runs
    finally:
        process.terminate()
        process.wait(timeout=30)

    print(f"{args.batch} long requests ({args.long_tokens} tokens each, streamed, greedy), one short "
          f"({args.short_tokens} tokens) sent {args.after:g} s later; server --max-batch {max_batch}; "
          f"{args.repeats} run(s) each" + (" (median, min-max)" if args.repeats > 1 else "") + "\n")
    print("| method | long tokens generated | long running at arrival | batch left at arrival s | short TTFT ms "
          "| short total ms | short done before batch | short alone: TTFT / total ms | same as alone |")
    print("|---|---|---:|---:|---:|---:|---|---|---|")
    for method, runs in out["methods"].items():
        generated = sorted({t for r in runs for t in r["long_tokens"]})
        print(f"| {method} | {min(generated)}-{max(generated)} | {spread(runs, 'running_at_arrival', 0)} | "
              f"{spread(runs, 'remaining_s', 2)} | {spread(runs, 'short_ttft_ms', 0)} | "
              f"{spread(runs, 'short_total_ms', 0)} | {sum(r['finished_before_batch'] for r in runs)}/{len(runs)} | "
              f"{statistics.median(r['alone_ttft_ms'] for r in runs):.0f} / "
              f"{statistics.median(r['alone_total_ms'] for r in runs):.0f} | "
              f"{all(r['same_as_alone'] for r in runs)} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if not all(r["same_as_alone"] for runs in out["methods"].values() for r in runs):
        raise SystemExit("a short answer differs from what its prompt gets alone")


if __name__ == "__main__":
    main()
