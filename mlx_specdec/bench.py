"""`mlx-specdec bench`: every method on the same prompts, in one run, against plain decoding.

One schema (`ROW_COLUMNS`, `SUMMARY_COLUMNS`) renders to Markdown, JSON and CSV (bench_report.py);
the pipeline bench (bench_pipeline.py) writes the same, its own figures in extra columns. Methods run
prompt-major (all methods on prompt 1, then prompt 2, ...) so slow drifts of a noisy machine
hit every method alike, and in an order rotated by one per prompt (and repeat), so whatever
favours a place in the order (warm caches, a cool chip) does not always favour the same method.
`speedup_vs_ar` is (method decode tokens/s) / (AR decode tokens/s), each pooled over the same
prompts within one repeat; over repeats we report the mean and the sd (`decode_tps_sd`,
`speedup_sd`: undefined with one repeat, so n/a in Markdown, null in JSON). For a lossless
method both write the same tokens, so this is AR decode time / method decode time; APAR writes
its own answer (its model is fine-tuned), so for it the ratio compares generated tokens per second.

When `apar` runs, every ar and apar answer is also scored by the original model (`answer_nll`:
mean NLL per token, `apar.quality`), and APAR's summary carries `nll_vs_ar`, its quality guard.

Long documents (`--context-length`, benchmarks/long_prompts.jsonl): a prompt that does not fit the
model's window with its answer (prompt tokens + max_tokens) is refused before anything runs, never
cut. A needle prompt (a pass key hidden in the document) gets `needle_found` per row and
`needles_found` (k/n) per method: a method that lost the document loses the key.
"""

from __future__ import annotations

import itertools
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Dict, Iterable, List, Optional

from .decoding import GenerationParams
from .engine import Engine, check_method

from .bench_prompts import DEFAULT_PROMPTS, LONG_PROMPTS, REPO_ROOT, Prompt, check_window, load_prompts  # noqa: F401
#: warm-up: a prompt longer than this is not warmed up on (its prefill would cost seconds per method)
WARMUP_MAX_TOKENS = 512
WARMUP_PROMPT = "Say hello in one short sentence."

TRAFFIC = ("syncs_per_step", "host_arrays_per_step", "host_idle_ms_per_step", "verify_shapes", "new_verify_shapes")
ROW_COLUMNS = [
    "method", "config", "prompt_id", "category", "repeat", "prompt_tokens", "new_tokens",
    "decode_tps", "ttft_ms", "decode_s", "forward_passes", "tokens_per_forward", "drafted",
    "accepted", "peak_memory_mb", "identical_to_ar", "compression", "acceptance_per_position",
    "threads", "max_cached_tokens", "flat_max_cached_tokens", "attended_tokens_mean",
    "flat_attended_tokens_mean", "answer_nll", "needle_found", "bottom_acceptance", "middle_acceptance",
    "attention_recall", "retrieval_rebuilds", "middle_forwards",
    # what a step costs the host (host_traffic.py; None where not counted: a pipeline's ranks)
    *TRAFFIC,
    # pipeline methods (bench_pipeline.py): runs launched through the ranks, each stage's idle fraction
    "runs", "speculative_runs", "cancelled", "tokens_per_pass", "stage_idle",
]
SUMMARY_COLUMNS = [
    "method", "config", "prompts", "new_tokens", "decode_tps", "decode_tps_sd", "speedup_vs_ar",
    "speedup_sd", "tokens_per_forward", "ttft_ms_median", "peak_memory_mb", "identical_fraction",
    "needles_found", "bottom_acceptance", "middle_acceptance", "attention_recall", "retrieval_rebuilds",
    "compression", "acceptance_per_position", "draft_ms_per_step", "verify_ms_per_step",
    "accept_ms_per_step", "pack_ms_per_step", "sync_ms_per_step",
    # what a step costs the host (host_traffic.py): medians over the answers
    *TRAFFIC,
    # apar: the paper's Tables 1, 2 and 7, each next to the flattened answer decoded sequentially
    "forked_fraction", "threads_mean", "threads_when_forked", "decode_steps_mean", "flat_decode_steps_mean",
    "max_cached_tokens_mean", "flat_max_cached_tokens_mean", "attended_tokens_mean",
    "flat_attended_tokens_mean", "answer_nll", "nll_vs_ar",
    # pipeline methods: against the paper's baseline (pp-spec) and pipelined ar's TTFT; the runs
    "speedup_vs_pp_spec", "ttft_vs_pp_ar", "tokens_per_pass", "runs", "speculative_runs", "cancelled",
    "acceptance", "stage_idle",
]
CATEGORY_COLUMNS = [
    "method", "config", "category", "prompts", "decode_tps", "speedup_vs_ar", "forked_fraction",
    "threads_mean", "threads_when_forked", "max_cached_tokens_mean", "flat_max_cached_tokens_mean",
    "attended_tokens_mean", "flat_attended_tokens_mean", "answer_nll", "nll_vs_ar",
]
#: method-specific figures copied from `GenerationStats.extra` into each row when present
EXTRA_FIELDS = ["steps", "compression", "acceptance_per_position", "tree_tokens_before_dedup",
                "tree_tokens_after_dedup", "draft_s", "verify_s", "accept_s", "pack_s", "sync_s",
                # apar: the answer's tree, and the same answer flattened and decoded sequentially
                "threads", "forked", "max_live_threads", "decode_steps", "max_cached_tokens",
                "attended_tokens_mean", "answer_tokens", "control_tokens", "flat_decode_steps",
                "flat_max_cached_tokens", "flat_attended_tokens_mean", "dropped_steps",
                # triforce: each level's acceptance, what the budget sees, rebuilds
                "bottom_acceptance", "middle_acceptance", "attention_recall", "retrieval_rebuilds", "middle_forwards",
                # pipeline methods: what the ranks report (bench_pipeline.py)
                "runs", "speculative_runs", "cancelled", "tokens_per_pass", "stage_idle"]
TRIFORCE_FIELDS = ("bottom_acceptance", "middle_acceptance", "attention_recall", "retrieval_rebuilds")


@dataclass
class MethodConfig:
    method: str
    options: Dict[str, object] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.options.items())) or "-"


def expand_configs(methods: Iterable[str], grids: Dict[str, Dict[str, List[object]]]) -> List[MethodConfig]:
    """Each method with every combination of its option lists (comma lists on the CLI)."""
    configs = []
    for method in methods:
        check_method(method)
        grid = grids.get(method, {})
        keys = sorted(grid)
        for values in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
            configs.append(MethodConfig(method, dict(zip(keys, values))))
    return configs


def environment(engine: Engine) -> Dict[str, object]:
    import mlx.core as mx
    import mlx_lm

    from . import _allocator, _blas, _jit

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    lm = engine.lm
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": f"{mx.default_device()} ({_device_name()})",
        "blas": _blas.loaded_blas,
        "malloc": _allocator.allocator,
        "jit_flags": _jit.jit_flags,  # MLX's CPU kernels (_jit.py)
        "machine": f"{platform.system()} {platform.machine()}, {__import__('os').cpu_count()} cores",
        "python": platform.python_version(),
        "model": lm.name,
        "dtype": lm.dtype,
        "bits": lm.bits or (32 if lm.dtype == "float32" else 16),
        "weights": lm.layout,  # row- or column-major on the CPU, as measured fastest there (model/cpu_layout.py)
        "git_commit": commit or "unknown",
        # redrafter's step length depends on it: `mlx-specdec calibrate` measures this machine's
        "verify_cost_table": engine.verify_costs.source if engine.verify_costs is not None else "none",
    }


def _device_name() -> str:
    import mlx.core as mx

    try:
        return str(mx.device_info().get("device_name", "?"))
    except Exception:  # an older MLX or a backend without the query: the device's kind is still named
        return "?"


def run_one(engine: Engine, prompt: Prompt, config: MethodConfig, base: GenerationParams):
    params = GenerationParams(max_tokens=base.max_tokens, temperature=base.temperature,
                              top_p=base.top_p, seed=base.seed, options=dict(config.options))
    from .apar.tree import restore_tokens

    events = list(engine.generate(prompt.text, method=config.method, params=params))
    stats = next(e.stats for e in events if e.kind == "done")
    return restore_tokens(events), stats  # the whole answer (APAR: its tree read in order)


def run_bench(engine: Engine, prompts: List[Prompt], configs: List[MethodConfig],
              params: GenerationParams, repeats: int = 1, progress: bool = True) -> dict:
    from tqdm import tqdm

    if not any(c.method == "ar" for c in configs):
        configs = [MethodConfig("ar")] + configs  # the reference for identity and speed-up
    counts = check_window(engine, prompts, params.max_tokens)
    # Warm-up: compile and allocate once per config, on a short run, before anything is timed. On
    # prompts[0], as always, unless it is long (a 6K-token document costs about a minute of prefill
    # per method on a 2-core CPU): then on the shortest prompt if that is short, else on a fixed
    # short one. The first timed long prefill then also allocates its bigger buffers: measured
    # here, 10.3 s against 9.7 s for the next one at 1.8K tokens (the malloc keeps freed memory).
    first = prompts[0]
    if counts[first.id] > WARMUP_MAX_TOKENS:
        shortest = min(prompts, key=lambda p: counts[p.id])
        first = shortest if counts[shortest.id] <= WARMUP_MAX_TOKENS else Prompt("warm-up", "-", WARMUP_PROMPT)
    warm = GenerationParams(max_tokens=8, temperature=params.temperature, seed=params.seed)
    for config in configs:
        run_one(engine, first, config, warm)

    rows: List[dict] = []
    reference: Dict[str, List[int]] = {}
    total = repeats * len(prompts) * len(configs)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress, file=sys.stderr)
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            # Rotated by one per prompt run: no method always runs first (or right after ar). The
            # identity check needs no order: it compares with ar's tokens after every run is done.
            shift = (repeat * len(prompts) + index) % len(configs)
            for config in configs[shift:] + configs[:shift]:
                bar.set_postfix_str(f"{config.method} #{prompt.id}")
                tokens, stats = run_one(engine, prompt, config, params)
                if config.method == "ar" and not config.options:
                    reference.setdefault(prompt.id, tokens)
                rows.append(result_row(config, prompt, repeat, stats, tokens))
                bar.update(1)
    bar.close()
    finish_rows(engine, prompts, rows, reference, progress)
    return {"environment": environment(engine), "params": params_record(params, repeats),
            "rows": rows, "summary": summarize(rows, configs, repeats)}


def result_row(config: MethodConfig, prompt: Prompt, repeat: int, stats, tokens: List[int]) -> dict:
    """One run's row of the schema (`_tokens`, the answer, is dropped once compared and scored).
    A figure the run could not measure is None (a pipeline's peak memory lives in its ranks)."""
    return {
        "method": config.method, "config": config.label, "prompt_id": prompt.id,
        "category": prompt.category, "repeat": repeat,
        "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.generated_tokens,
        "decode_tps": round(stats.decode_tps, 2), "ttft_ms": round(stats.ttft_s * 1000, 1),
        "decode_s": round(stats.decode_s, 4), "forward_passes": stats.forward_passes,
        "tokens_per_forward": round(stats.tokens_per_forward, 3),
        "drafted": stats.drafted, "accepted": stats.accepted,
        "peak_memory_mb": _round(stats.peak_memory_mb, 1),
        "_tokens": tokens,
        **{k: stats.extra.get(k) for k in TRAFFIC},
        **{k: stats.extra[k] for k in EXTRA_FIELDS if k in stats.extra},
    }


def finish_rows(engine: Engine, prompts: List[Prompt], rows: List[dict], reference: Dict[str, List[int]],
                progress: bool = True) -> None:
    """Each row's answer against ar's (`reference`, by prompt id), a needle's pass key, APAR's
    quality score; then the answers are dropped."""
    expected = {p.id: p.expected for p in prompts if p.expected}
    for row in rows:
        ref = reference.get(row["prompt_id"])
        row["identical_to_ar"] = ref is not None and row["_tokens"] == ref
        if row["prompt_id"] in expected:  # a needle: did the answer keep the pass key?
            row["needle_found"] = expected[row["prompt_id"]] in engine.lm.tokenizer.decode(row["_tokens"])
    if any(r["method"] == "apar" for r in rows):
        score_answers(engine, prompts, rows, progress)
    for row in rows:
        del row["_tokens"]


def score_answers(engine: Engine, prompts: List[Prompt], rows: List[dict], progress: bool = True) -> None:
    """APAR's quality guard: every ar and apar answer's mean NLL under the original model."""
    from tqdm import tqdm

    from .apar.quality import answer_nll

    texts = {p.id: p.text for p in prompts}
    scored = [r for r in rows if r["method"] in ("ar", "apar")]
    for row in tqdm(scored, desc="score (NLL under the original model)", unit="answer",
                    disable=not progress, file=sys.stderr):
        prompt_ids = engine.lm.encode_prompt(texts[row["prompt_id"]])
        nll = answer_nll(engine.lm, prompt_ids, engine.lm.tokenizer.decode(row["_tokens"]))
        row["answer_nll"] = None if nll != nll else round(nll, 4)  # NaN (empty answer): no score


def params_record(params: GenerationParams, repeats: int) -> dict:
    return {"max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "seed": params.seed, "repeats": repeats}


def _mean_sd(values: List[float]) -> tuple[float, Optional[float]]:
    """Mean and sample sd; the sd is None (undefined, not 0) with fewer than two values."""
    if not values:
        return 0.0, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)


def summarize(rows: List[dict], configs: List[MethodConfig], repeats: int) -> List[dict]:
    summary = []
    for config in configs:
        mine = [r for r in rows if r["method"] == config.method and r["config"] == config.label]
        if not mine:
            continue
        tps, speedups = [], []
        ar_rows = _ar_rows(rows)
        for repeat in range(repeats):
            this = [r for r in mine if r["repeat"] == repeat]
            tps.append(_decode_tps(this))
            speedups.append(_speedup(this, ar_rows))
        tps_mean, tps_sd = _mean_sd(tps)
        speed_mean, speed_sd = _mean_sd(speedups)
        forwards = sum(r["forward_passes"] for r in mine)
        summary.append({
            "method": config.method, "config": config.label,
            "prompts": len({r["prompt_id"] for r in mine}),
            "new_tokens": sum(r["new_tokens"] for r in mine),
            "decode_tps": round(tps_mean, 2), "decode_tps_sd": _round(tps_sd, 2),
            "speedup_vs_ar": round(speed_mean, 3), "speedup_sd": _round(speed_sd, 3),
            "tokens_per_forward": round(sum(r["new_tokens"] for r in mine) / forwards, 3) if forwards else 0.0,
            "ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in mine), 1),
            "peak_memory_mb": max((r["peak_memory_mb"] for r in mine if r["peak_memory_mb"] is not None),
                                  default=None),
            "identical_fraction": round(sum(r["identical_to_ar"] for r in mine) / len(mine), 3),
            **_needles(mine),
            **_speculation_summary(mine),
            **_traffic_summary(mine),
            **_apar_summary(mine, rows),
            **{k: round(statistics.mean(r[k] for r in mine), 3) for k in TRIFORCE_FIELDS
               if all(k in r for r in mine)},  # triforce: means over prompts
        })
    return summary


def _needles(rows: List[dict]) -> dict:
    """'k/n': of n needle answers (prompts x repeats), k contain their pass key; none without needles."""
    needles = [r["needle_found"] for r in rows if "needle_found" in r]
    return {"needles_found": f"{sum(needles)}/{len(needles)}"} if needles else {}


def _decode_tps(rows: List[dict]) -> float:
    """Decode tokens per second pooled over rows (the first token is the prefill's)."""
    seconds = sum(r["decode_s"] for r in rows)
    return sum(max(r["new_tokens"] - 1, 0) for r in rows) / seconds if seconds else 0.0


def _ar_rows(rows: List[dict]) -> Dict[tuple, dict]:
    return {(r["prompt_id"], r["repeat"]): r for r in rows if r["method"] == "ar" and r["config"] == "-"}


def _speedup(rows: List[dict], ar_rows: Dict[tuple, dict]) -> float:
    """Decode tok/s of these rows over plain decoding's tok/s on the same prompts and repeats."""
    ar = [ar_rows[(r["prompt_id"], r["repeat"])] for r in rows if (r["prompt_id"], r["repeat"]) in ar_rows]
    mine, base = _decode_tps(rows), _decode_tps(ar)
    return mine / base if base else 0.0


def _mean(values: List[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _apar_summary(mine: List[dict], rows: List[dict]) -> dict:
    """APAR's figures (threads, forks, cached and attended tokens, next to the flattened answer's)
    and the quality guard: answer NLL under the original model, and its ratio to ar's."""
    out: dict = {}
    with_tree = [r for r in mine if "threads" in r]
    if with_tree:
        forked = [r for r in with_tree if r["forked"]]
        out["forked_fraction"] = round(len(forked) / len(with_tree), 3)
        out["threads_mean"] = round(_mean([r["threads"] for r in with_tree]), 2)
        out["threads_when_forked"] = round(_mean([r["threads"] for r in forked]), 2) if forked else None
        for key in ("decode_steps", "flat_decode_steps", "max_cached_tokens", "flat_max_cached_tokens",
                    "attended_tokens_mean", "flat_attended_tokens_mean"):
            name = key if key.endswith("_mean") else f"{key}_mean"
            out[name] = round(_mean([r[key] for r in with_tree]), 1)
    nll = _mean([r.get("answer_nll") for r in mine])
    if nll is not None:
        out["answer_nll"] = round(nll, 4)
        ar = _ar_rows(rows)
        pairs = [(r["answer_nll"], ar[key]["answer_nll"]) for r in mine
                 if r.get("answer_nll") is not None and (key := (r["prompt_id"], r["repeat"])) in ar
                 and ar[key].get("answer_nll") is not None]
        if pairs and sum(a for _, a in pairs):  # both means over the same prompts
            out["nll_vs_ar"] = round(sum(m for m, _ in pairs) / sum(a for _, a in pairs), 3)
    return out


def _traffic_summary(rows: List[dict]) -> dict:
    """Blocking reads and host-built arrays per step, verify shapes per answer: medians."""
    counted = {k: [r[k] for r in rows if r.get(k) is not None] for k in TRAFFIC}
    return {k: statistics.median(v) if v else None for k, v in counted.items()}


def _speculation_summary(rows: List[dict]) -> dict:
    """Draft-and-verify figures over all rows that have them, weighted by decoding steps."""
    rows = [r for r in rows if r.get("steps")]
    if not rows:
        return {}
    steps = sum(r["steps"] for r in rows)
    depth = max(len(r["acceptance_per_position"]) for r in rows)
    acceptance = [sum(r["acceptance_per_position"][k] * r["steps"] for r in rows
                      if k < len(r["acceptance_per_position"])) / steps for k in range(depth)]
    before = sum(r["tree_tokens_before_dedup"] for r in rows)
    after = sum(r["tree_tokens_after_dedup"] for r in rows)
    out = {"acceptance_per_position": [round(a, 3) for a in acceptance],
           "compression": round(1 - after / before, 3) if before else 0.0}
    for phase in ("draft", "verify", "accept", "pack", "sync"):
        if any(f"{phase}_s" in r for r in rows):
            out[f"{phase}_ms_per_step"] = round(1000 * sum(r.get(f"{phase}_s", 0) for r in rows) / steps, 2)
    return out


# -- per category: which method wins where ---------------------------------------------------------

def per_category(result: dict) -> List[dict]:
    """Per method config and prompt category, pooled over prompts and repeats: decode tok/s,
    speed-up over plain decoding (tok/s ratio on the same prompts), APAR's figures where present;
    plus an 'all' category."""
    rows = result["rows"]
    ar_rows = _ar_rows(rows)
    categories = sorted({r["category"] for r in rows})
    categories += ["all"] if len(categories) > 1 else []
    out = []
    for s in result["summary"]:
        for category in categories:
            mine = [r for r in rows if r["method"] == s["method"] and r["config"] == s["config"]
                    and (category == "all" or r["category"] == category)]
            out.append({"method": s["method"], "config": s["config"], "category": category,
                        "prompts": len({r["prompt_id"] for r in mine}), "decode_tps": _decode_tps(mine),
                        "speedup_vs_ar": _speedup(mine, ar_rows), **_apar_summary(mine, rows)})
    return out
