"""`mlx-specdec bench --methods ar,pp-ar,pp-spec,pipeinfer --ranks 2`: pipeline methods against
single-process `ar` on the same prompts.

`ar` runs here, in this process, with the whole machine; the pipeline methods run in one launch
of the ranks (the model loads once per rank), every prompt through every method, in an order
rotated per prompt. Decode tok/s is pooled over prompts: (tokens after the first) / (time after
the first token), as the main bench. Per method: speed-up over `ar` and over `pp-spec` (the
paper's baseline), TTFT against `pp-ar`'s, tokens per pipeline pass (answer tokens per decode
run launched), runs launched and cancelled, each stage's idle fraction, and identical output.
"""

from __future__ import annotations

import statistics
from typing import Dict, List

from .cli.pipeline import PIPELINE_METHODS, pipeline_settings, run_jobs

COLUMNS = ["method", "prompts", "new_tokens", "decode_tps", "speedup_vs_ar", "speedup_vs_pp_spec", "ttft_ms_median",
           "ttft_vs_pp_ar", "tokens_per_pass", "runs", "speculative_runs", "cancelled", "acceptance",
           "stage_idle", "identical_fraction"]


def _pooled(rows: List[dict]) -> float:
    tokens = sum(max(r["new_tokens"] - 1, 0) for r in rows)
    return tokens / max(sum(r["decode_s"] for r in rows), 1e-9)


def run_pipeline_bench(args, engine, prompts, methods: List[str], params) -> Dict[str, object]:
    from tqdm import tqdm

    rows: List[dict] = []
    reference: Dict[str, List[int]] = {}
    for prompt in tqdm(prompts, desc="ar (one process)", unit="prompt"):
        events = list(engine.generate(prompt.text, "ar", params))
        stats = next(e.stats for e in events if e.kind == "done")
        tokens = [t for e in events if e.kind == "token" for t in e.tokens]
        reference[prompt.id] = tokens
        rows.append(dict(method="ar", prompt_id=prompt.id, new_tokens=len(tokens), decode_s=stats.decode_s,
                         ttft_s=stats.ttft_s, identical=True))
    pipelined = [m for m in methods if m in PIPELINE_METHODS]
    jobs, keys = [], []
    for index, prompt in enumerate(prompts):
        ids = engine.lm.encode_prompt(prompt.text, chat=True)
        for k in range(len(pipelined)):
            method = pipelined[(index + k) % len(pipelined)]
            jobs.append(dict(prompt=ids, settings=pipeline_settings(args, method, params.max_tokens)))
            keys.append((method, prompt.id))
    bar = tqdm(total=len(jobs), desc="pipeline", unit="run")
    answers: Dict[int, List[int]] = {}
    ranks_event: Dict[str, object] = {}

    def collect(event: dict) -> None:
        if "parameter_mb" in event:
            ranks_event.update(event)
        if "tokens" in event:
            answers.setdefault(event["job"], []).extend(event["tokens"])
        if "stats" in event:
            method, prompt_id = keys[event["job"]]
            s = event["stats"]
            rows.append(dict(method=method, prompt_id=prompt_id, identical=answers.get(event["job"], []) ==
                             reference[prompt_id], **{k: s[k] for k in ("new_tokens", "decode_s", "ttft_s", "runs",
                                                                        "speculative_runs", "cancelled", "drafted",
                                                                        "accepted", "tokens_per_pass", "stage_idle")}))
            bar.update(1)

    run_jobs(args, str(engine.lm.path), jobs, collect)
    bar.close()
    return dict(rows=rows, summary=summarize(rows, ["ar"] + pipelined), ranks=ranks_event)


def summarize(rows: List[dict], methods: List[str]) -> List[dict]:
    by = {m: [r for r in rows if r["method"] == m] for m in methods}
    ar_tps = _pooled(by["ar"])
    out = []
    for method in methods:
        mine = by[method]
        if not mine:
            continue
        tps = _pooled(mine)
        ttft = statistics.median(r["ttft_s"] for r in mine) * 1000
        row = dict(method=method, prompts=len(mine), new_tokens=sum(r["new_tokens"] for r in mine),
                   decode_tps=round(tps, 2), speedup_vs_ar=round(tps / ar_tps, 3), ttft_ms_median=round(ttft, 1),
                   identical_fraction=round(sum(r["identical"] for r in mine) / len(mine), 3))
        if method != "ar":
            drafted = sum(r["drafted"] for r in mine)
            row.update(tokens_per_pass=round(statistics.mean(r["tokens_per_pass"] for r in mine), 3),
                       runs=sum(r["runs"] for r in mine), speculative_runs=sum(r["speculative_runs"] for r in mine),
                       cancelled=sum(r["cancelled"] for r in mine),
                       acceptance=round(sum(r["accepted"] for r in mine) / drafted, 3) if drafted else None,
                       stage_idle=[round(statistics.mean(r["stage_idle"][i] for r in mine), 3)
                                   for i in range(len(mine[0]["stage_idle"]))])
        out.append(row)
    spec = next((r for r in out if r["method"] == "pp-spec"), None)
    base = next((r for r in out if r["method"] == "pp-ar"), None)
    for row in out:
        if spec:
            row["speedup_vs_pp_spec"] = round(row["decode_tps"] / spec["decode_tps"], 3)
        if base:
            row["ttft_vs_pp_ar"] = round(row["ttft_ms_median"] / base["ttft_ms_median"], 3)
    return out


def render(result: Dict[str, object], environment: str) -> str:
    lines = [f"# Pipeline bench\n\n{environment}\n", f"Ranks: {result['ranks']}\n",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in result["summary"]:
        lines.append("| " + " | ".join("" if row.get(c) is None else str(row.get(c)) for c in COLUMNS) + " |")
    lines += ["", "| method | prompt | new tokens | decode tok/s | TTFT ms | tokens/pass | cancelled | identical |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        rate = max(r["new_tokens"] - 1, 0) / max(r["decode_s"], 1e-9)
        lines.append(f"| {r['method']} | {r['prompt_id']} | {r['new_tokens']} | {rate:.2f} | {r['ttft_s'] * 1000:.0f} "
                     f"| {r.get('tokens_per_pass', '')} | {r.get('cancelled', '')} | {r['identical']} |")
    return "\n".join(lines) + "\n"
