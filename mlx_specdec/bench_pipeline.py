"""`mlx-specdec bench --methods ar,pp-ar,pp-spec,pipeinfer --ranks 2`: pipeline methods against
single-process `ar` on the same prompts, written in the main bench's schema (bench.py), so that
every format (bench_report.py) reads the same whichever bench made it.

`ar` runs here, in this process, with the whole machine; the pipeline methods run in one launch
of the ranks (the model loads once per rank), every prompt through every method, in an order
rotated per prompt. Decode tok/s is pooled over prompts: (tokens after the first) / (time after
the first token), as the main bench. A pipeline row's forward passes are its decode runs plus the
run that gave the first token (the main bench counts from the last prompt token on); its peak
memory is the ranks' and not measured here (None: n/a, null). Beside the main bench's columns: runs
launched, speculative and cancelled, tokens per pipeline pass (answer tokens per decode run),
each stage's idle fraction, draft acceptance, speed-up over `pp-spec` (the paper's baseline) and
TTFT against `pp-ar`'s.
"""

from __future__ import annotations

import statistics
from typing import Dict, List

from .bench import MethodConfig, params_record, environment, finish_rows, result_row, run_one, summarize
from .cli.pipeline import PIPELINE_METHODS, pipeline_settings, run_jobs
from .decoding import GenerationStats

#: what each pipeline method reads of the pipeline settings: its config label
METHOD_SETTINGS = {"pp-ar": (), "pp-spec": ("draft_length",),
                   "pipeinfer": ("micro_batch", "max_runs", "p_accept", "p_recovery", "p_decay")}
#: what the ranks report per run, kept in the row
RANK_FIELDS = ("runs", "speculative_runs", "cancelled", "tokens_per_pass", "stage_idle")


def pipeline_config(args, method: str) -> MethodConfig:
    """The method with the settings it runs with (a cutoff step of 0, off, is left out)."""
    settings = pipeline_settings(args, method, 0)
    options = {k: settings[k] for k in METHOD_SETTINGS[method] if k not in ("p_recovery", "p_decay") or settings[k]}
    if method != "pp-ar":
        options["drafter"] = args.pp_drafter
    return MethodConfig(method, options)


def rank_stats(method: str, prompt_tokens: int, s: dict) -> GenerationStats:
    """The ranks' stats event as the main bench's stats."""
    return GenerationStats(method=method, prompt_tokens=prompt_tokens, generated_tokens=s["new_tokens"],
                           ttft_s=s["ttft_s"], decode_s=s["decode_s"], forward_passes=s["decode_runs"] + 1,
                           drafted=s["drafted"], accepted=s["accepted"], peak_memory_mb=None,
                           extra={k: s[k] for k in RANK_FIELDS})


def run_pipeline_bench(args, engine, prompts, methods: List[str], params, repeats: int = 1,
                       progress: bool = True) -> Dict[str, object]:
    from tqdm import tqdm

    ar = MethodConfig("ar")
    pipelined = [pipeline_config(args, m) for m in methods if m in PIPELINE_METHODS]
    rows: List[dict] = []
    reference: Dict[str, List[int]] = {}
    for repeat in range(repeats):
        for prompt in tqdm(prompts, desc="ar (one process)", unit="prompt", disable=not progress):
            tokens, stats = run_one(engine, prompt, ar, params)
            reference.setdefault(prompt.id, tokens)
            rows.append(result_row(ar, prompt, repeat, stats, tokens))
    jobs, keys = [], []
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            ids = engine.lm.encode_prompt(prompt.text, chat=True)
            shift = repeat * len(prompts) + index
            for k in range(len(pipelined)):
                config = pipelined[(shift + k) % len(pipelined)]
                jobs.append(dict(prompt=ids, settings=pipeline_settings(args, config.method, params.max_tokens)))
                keys.append((config, prompt, repeat, len(ids)))
    bar = tqdm(total=len(jobs), desc="pipeline", unit="run", disable=not progress)
    answers: Dict[int, List[int]] = {}
    ranks: Dict[str, object] = {}

    def collect(event: dict) -> None:
        if "parameter_mb" in event:
            ranks.update(event)
        if "tokens" in event:
            answers.setdefault(event["job"], []).extend(event["tokens"])
        if "stats" in event:
            config, prompt, repeat, prompt_tokens = keys[event["job"]]
            stats = rank_stats(config.method, prompt_tokens, event["stats"])
            rows.append(result_row(config, prompt, repeat, stats, answers.get(event["job"], [])))
            bar.update(1)

    run_jobs(args, str(engine.lm.path), jobs, collect)
    bar.close()
    finish_rows(engine, prompts, rows, reference, progress)
    summary = summarize(rows, [ar] + pipelined, repeats)
    add_pipeline_summary(summary, rows)
    env = dict(environment(engine), ranks=ranks.get("ranks"), split=ranks.get("split"),
               parameter_mb=ranks.get("parameter_mb"), hostfile=args.hostfile or "none (local ranks)",
               link=f"+{args.link_latency_ms} ms, {args.link_gbps or 'loopback'} Gbit/s"
               if args.link_latency_ms or args.link_gbps else "loopback")
    return {"environment": env, "params": params_record(params, repeats), "rows": rows, "summary": summary}


def add_pipeline_summary(summary: List[dict], rows: List[dict]) -> None:
    """The pipeline's figures on each summary record: runs, cancellations, acceptance and stage idle
    for the pipeline methods; speed-up over pp-spec and TTFT over pp-ar's for every method."""
    for s in summary:
        mine = [r for r in rows if r["method"] == s["method"] and r["config"] == s["config"]]
        if s["method"] not in PIPELINE_METHODS or not mine:
            continue
        drafted = sum(r["drafted"] for r in mine)
        s.update(tokens_per_pass=round(statistics.mean(r["tokens_per_pass"] for r in mine), 3),
                 runs=sum(r["runs"] for r in mine), speculative_runs=sum(r["speculative_runs"] for r in mine),
                 cancelled=sum(r["cancelled"] for r in mine),
                 acceptance=round(sum(r["accepted"] for r in mine) / drafted, 3) if drafted else None,
                 stage_idle=[round(statistics.mean(r["stage_idle"][i] for r in mine), 3)
                             for i in range(len(mine[0]["stage_idle"]))])
    spec = next((s for s in summary if s["method"] == "pp-spec"), None)
    base = next((s for s in summary if s["method"] == "pp-ar"), None)
    for s in summary:
        if spec and spec["decode_tps"]:
            s["speedup_vs_pp_spec"] = round(s["decode_tps"] / spec["decode_tps"], 3)
        if base and base["ttft_ms_median"]:
            s["ttft_vs_pp_ar"] = round(s["ttft_ms_median"] / base["ttft_ms_median"], 3)
