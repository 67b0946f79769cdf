"""`train-drafter --budget-minutes`: one wall-clock budget for the whole command.

The pieces here are small and separately testable:

* `measure_batches` / `pick_batch`: generated tokens per second of the data generator at a few
  batch sizes (a short answer cap, a few prompts) and the best of them (`--data-batch auto`).
* `block_order` / `plan_blocks` / `plan_training`: the plan. The prompts are cut into blocks of
  `BLOCK_PROMPTS` in file order; the first block's time gives prompts per second, and the plan
  distils as many blocks as fit in `DATA_SHARE` of the budget (re-planned after each block at the
  rate so far), then trains for as many steps as the measured step rate fits into what is left, less
  a reserve for the held-out evaluation and saving. Blocks are a fixed order, so any plan is a prefix
  of the same blocks and a resumed run finds its finished blocks again.
* `Progress`: done / total with rate and ETA, tqdm's updating line on a terminal, a plain line every
  `every` seconds otherwise (a log file must not fill with carriage returns).
* `estimate_mac`: the cost model for a 7B 4-bit model on an M-series Mac (see docs/training.md).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

BLOCK_PROMPTS = 64  # prompts per distillation block (one train and at most one valid shard each)
DATA_SHARE = 0.5  # of the budget spent distilling data; training gets the rest
RESERVE_SHARE, RESERVE_MIN_S = 0.04, 30.0  # kept back for the held-out evaluation and saving
TRAIN_SAFETY = 0.95  # planned steps fill this share of the training time (the rate is a short sample)
MAX_BUDGET_EPOCHS = 8.0  # a small prompt set with a long budget stops here rather than overfit
AUTO_BATCHES = (8, 16, 32, 64)
AUTO_MAX_NEW_TOKENS = 24  # answer cap of the batch measurement: long enough to reach steady decode


# ---- batch size ---------------------------------------------------------------------------------

def pick_batch(table: Dict[int, float]) -> int:
    """The batch with the most tokens per second (the smaller one on a tie: less padding, less memory)."""
    if not table:
        raise ValueError("no batch sizes were measured")
    return min(table, key=lambda b: (-table[b], b))


def measure_batches(lm, encoded: Sequence[List[int]], batches: Sequence[int] = AUTO_BATCHES,
                    max_new_tokens: int = AUTO_MAX_NEW_TOKENS,
                    clock: Callable[[], float] = time.perf_counter) -> Dict[int, float]:
    """Generated tokens per second at each batch size, on the first B prompts of `encoded` (repeated
    where there are fewer), after one small warm-up batch."""
    from .data import batched_greedy

    batched_greedy(lm, list(encoded[:2]), 4)  # warm-up: allocations and kernels
    table = {}
    for b in batches:
        prompts = [encoded[i % len(encoded)] for i in range(b)]
        begin = clock()
        tokens = sum(len(r[0]) for r in batched_greedy(lm, prompts, max_new_tokens))
        table[b] = tokens / max(clock() - begin, 1e-9)
    return table


def batch_table_line(table: Dict[int, float], chosen: int, seconds: float) -> str:
    cells = ", ".join(f"{b}: {v:.0f}{' *' if b == chosen else ''}" for b, v in sorted(table.items()))
    return f"data batch auto (tokens/s by batch, short answers, {seconds:.0f} s): {cells} -> batch {chosen}"


def block_order(prompt_counts: Sequence[int], block: int = BLOCK_PROMPTS) -> List[Tuple[int, int]]:
    """(file index, block index) in distillation order: each file's blocks in file order, the files
    interleaved in proportion so that any prefix takes from every file by its size."""
    keyed = []
    for f, n in enumerate(prompt_counts):
        blocks = math.ceil(n / block)
        keyed += [((i + 0.5) / blocks, f, i) for i in range(blocks)]
    return [(f, i) for _, f, i in sorted(keyed)]


def reserve_seconds(budget_s: float) -> float:
    return max(RESERVE_MIN_S, RESERVE_SHARE * budget_s)


def plan_blocks(budget_s: float, elapsed_s: float, block_prompts: Sequence[int], done: int,
                prompts_per_s: float) -> int:
    """How many blocks (a prefix of `block_prompts`, the prompts of each block in order) to distil so
    that data ends near DATA_SHARE of the budget: the `done` blocks, then those that fit in the data
    time left at `prompts_per_s`; at least the done ones, at most all."""
    left_s = DATA_SHARE * budget_s - elapsed_s
    room = max(0.0, left_s) * prompts_per_s  # prompts that still fit
    n = done
    while n < len(block_prompts) and room >= block_prompts[n]:
        room -= block_prompts[n]
        n += 1
    return max(n, min(done, len(block_prompts)))


def plan_training(left_s: float, steps_per_s: float, steps_per_epoch: int,
                  max_epochs: float = MAX_BUDGET_EPOCHS) -> Tuple[int, float]:
    """(steps, epochs) that fill TRAIN_SAFETY of `left_s` seconds at `steps_per_s`, at least one step,
    at most `max_epochs` over the data."""
    steps = int(TRAIN_SAFETY * max(0.0, left_s) * steps_per_s)
    steps = max(1, min(steps, int(max_epochs * steps_per_epoch)))
    return steps, steps / steps_per_epoch


def _clock_text(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """done / total, rate and ETA. On a terminal: tqdm's single updating line; otherwise one line
    every `every` seconds (and one at the end) through `log`. `enabled=False`: silent."""

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0, every: float = 30.0,
                 log: Optional[Callable[[str], None]] = None, enabled: bool = True,
                 tty: Optional[bool] = None, clock: Callable[[], float] = time.perf_counter):
        self.total, self.desc, self.unit, self.n, self.every = total, desc, unit, initial, every
        self.start_n, self.postfix, self.clock = initial, {}, clock
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.enabled = enabled
        tty = sys.stderr.isatty() if tty is None else tty
        self.bar = None
        if enabled and tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, mininterval=2)
        self.t0 = self.last = clock()
        self.logged = initial  # n at the last line written (the closing line is not written twice)

    def line(self) -> str:
        spent = self.clock() - self.t0
        rate = (self.n - self.start_n) / spent if spent > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else float("nan")
        post = "".join(f", {k}={v}" for k, v in self.postfix.items())
        return (f"{self.desc}: {self.n}/{self.total} {self.unit}s, {rate:.2f} {self.unit}/s, "
                f"{_clock_text(spent)} spent, ETA {_clock_text(eta) if eta == eta else '?'}{post}")

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and self.clock() - self.last >= self.every:
            self.last, self.logged = self.clock(), self.n
            self.log(self.line())

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}
        if self.bar is not None:
            self.bar.set_postfix(**values, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.n > self.logged:
            self.log(self.line())


# ---- the cost model ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Mac:
    """An M-series Mac's memory bandwidth and GPU fp32 peak (sources in docs/training.md)."""
    name: str
    bandwidth: float  # bytes / s
    flops: float  # FLOP / s


MACS = (Mac("M2 Pro", 200e9, 6.8e12), Mac("M3 Max", 400e9, 14.2e12))


@dataclass(frozen=True)
class Target:
    """The model the estimate is for: a 7B Llama-shaped model in 4-bit (Mistral-7B's shapes)."""
    name: str = "7B 4-bit"
    weight_bytes: float = 3.8e9  # 4-bit weights with group scales
    params: float = 7.2e9  # 2 FLOP per parameter per token
    kv_bytes_per_token: float = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head dim x fp16
    hidden_size: int = 4096
    embed_size: int = 4096


TRAIN_EFFICIENCY = 0.5  # share of the GPU's peak the head's training matmuls reach (an assumption)


def decode_seconds(batch: int, context: float, target: Target, mac: Mac) -> float:
    """One decode forward of `batch` rows at `context` keys: reading the weights and the KV cache once
    at the memory bandwidth, or the matmuls at the GPU's peak, whichever is longer."""
    read = (target.weight_bytes + batch * context * target.kv_bytes_per_token) / mac.bandwidth
    compute = batch * 2 * target.params / mac.flops
    return max(read, compute)


def head_train_flops(hidden: int, embed: int, draft_vocab: int, blocks: int, draft_length: int,
                     batch: int, output: str = "llm_head") -> float:
    """FLOP of one training step of the head: per window and draft position the multiply-adds of
    U, W (E x E each), the blocks ((D+E)^2 each) and the output (llm_head: (D+E) x D then D x K;
    draft_vocab: (D+E) x K), times 2 FLOP per multiply-add, times 3 for forward + backward."""
    width = hidden + embed
    out = width * hidden + hidden * draft_vocab if output == "llm_head" else width * draft_vocab
    macs = 2 * embed * embed + blocks * width * width + out
    return 3 * 2 * macs * draft_length * batch


def estimate_mac(data_tokens: int, context: float, train_steps: int, draft_vocab: int, blocks: int,
                 draft_length: int, batch_size: int, output: str, target: Target = Target(),
                 mac: Mac = MACS[0], batches: Sequence[int] = AUTO_BATCHES) -> Dict[str, float]:
    """Minutes the same job (as many answer tokens, as many training steps) would take for `target`
    on `mac`: data at the best of `batches` (batch / decode_seconds), training at TRAIN_EFFICIENCY
    of the peak. Prefill, evaluation and saving are left out (small beside decoding)."""
    rates = {b: b / decode_seconds(b, context, target, mac) for b in batches}
    batch = pick_batch(rates)
    step_flops = head_train_flops(target.hidden_size, target.embed_size, draft_vocab, blocks,
                                  draft_length, batch_size, output)
    step_s = step_flops / (TRAIN_EFFICIENCY * mac.flops)
    data_min = data_tokens / rates[batch] / 60
    train_min = train_steps * step_s / 60
    return {"mac": mac.name, "bandwidth_gb_s": mac.bandwidth / 1e9, "gpu_tflop_s": mac.flops / 1e12,
            "data_batch": batch, "data_tokens_per_s": round(rates[batch], 1),
            "train_steps_per_s": round(1 / step_s, 2), "data_minutes": round(data_min, 1),
            "train_minutes": round(train_min, 1), "total_minutes": round(data_min + train_min, 1),
            "hidden_state_gb": round(data_tokens * target.hidden_size * 2 / 1e9, 2)}


def cost_lines(cost: Dict[str, object]) -> List[str]:
    here = cost["here"]
    lines = [f"cost here: data {here['data_tokens_per_s']} tokens/s at batch {here['data_batch']} "
             f"({here['data_tokens']} tokens, {here['data_minutes']} min), training "
             f"{here['train_steps_per_s']} steps/s ({here['train_steps']} steps, {here['train_minutes']} min, "
             f"{here['train_gflop_s']} GFLOP/s), {here['total_minutes']} min in all"]
    for e in cost["estimate_7b_4bit"]:
        lines.append(f"estimate 7B 4-bit on {e['mac']} ({e['bandwidth_gb_s']:g} GB/s, {e['gpu_tflop_s']:g} TFLOP/s): "
                     f"data {e['data_tokens_per_s']} tokens/s at batch {e['data_batch']} -> {e['data_minutes']} min, "
                     f"training {e['train_steps_per_s']} steps/s -> {e['train_minutes']} min, "
                     f"{e['total_minutes']} min in all ({e['hidden_state_gb']} GB of hidden states)")
    return lines


CONTEXT_PROMPT = 64  # prompt tokens (chat template included) assumed ahead of each answer in the KV term


def cost_report(data_stats: Dict, result, cfg, data_tokens: int, mean_answer: float, hidden: int,
                embed: int, draft_vocab: int, total_s: float) -> Dict[str, object]:
    """Measured here (data tokens/s at the batch used, training steps/s, minutes) and the same job's
    estimate for a 7B 4-bit model on each of MACS. `data_stats`: tokens, seconds, batch of the data
    generated (none on a run that only trained); `result`: the TrainResult."""
    seconds = data_stats.get("seconds") or 0.0
    step_flops = head_train_flops(hidden, embed, draft_vocab, cfg.num_blocks, cfg.draft_length,
                                  cfg.batch_size, cfg.output)
    here = {"data_batch": data_stats.get("batch"), "data_tokens": int(data_stats.get("tokens", 0)),
            "data_minutes": round(seconds / 60, 1),
            "data_tokens_per_s": round(data_stats["tokens"] / seconds, 1) if seconds else None,
            "train_steps": result.steps, "train_minutes": round(result.wall_s / 60, 1),
            "train_steps_per_s": round(result.steps_per_s, 2),
            "train_gflop_s": round(step_flops * result.steps_per_s / 1e9, 1),
            "total_minutes": round(total_s / 60, 1)}
    context = CONTEXT_PROMPT + mean_answer / 2
    target = Target()
    estimates = [estimate_mac(data_tokens, context, result.steps, draft_vocab, cfg.num_blocks,
                              cfg.draft_length, cfg.batch_size, cfg.output, target, mac) for mac in MACS]
    return {"here": here, "estimate_7b_4bit": estimates,
            "assumptions": {"weight_bytes": target.weight_bytes, "params": target.params,
                            "kv_bytes_per_token": target.kv_bytes_per_token, "mean_context": round(context, 1),
                            "hidden_size": target.hidden_size, "train_efficiency": TRAIN_EFFICIENCY,
                            "data_tokens": data_tokens, "train_steps": result.steps}}


# ---- the budgeted command -----------------------------------------------------------------------

PROBE_STEPS = 12  # training steps timed (after the warm-up ones) to plan the training time


def run_budget(lm, prompts: Sequence, data_dir, output, checkpoint_dir, cfg, budget_minutes: float,
               max_new_tokens: int, data_batch, started: float, log: Callable[[str], None],
               clock: Callable[[], float] = time.perf_counter) -> Dict[str, object]:
    """`train-drafter --budget-minutes`: batch, data plan, data, training plan, training, evaluation,
    all inside `budget_minutes` from `started`. The plan is kept in <data_dir>/budget.json, so the
    same command resumes it (finished blocks and the training checkpoint are kept)."""
    import json
    from dataclasses import replace
    from pathlib import Path

    from ..errors import UserError
    from .data import distil_block, load_train_prompts, row_messages
    from .teacher_forcing import Windows
    from .train import _existing_split, train_and_save, train_head, usable_splits

    budget_s, data_dir = 60 * budget_minutes, Path(data_dir)
    plan_file = data_dir / "budget.json"
    key = {"budget_minutes": budget_minutes, "max_new_tokens": max_new_tokens,
           "prompts": [str(p) for p in prompts], "model": lm.name}
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else dict(key)
    if any(plan.get(k) != v for k, v in key.items()):
        raise UserError(f"{plan_file} plans another model, --budget-minutes, --max-new-tokens or --prompts; "
                        "pass the same ones or another --data-dir")
    directories = [data_dir / Path(p).stem for p in prompts]
    for directory in directories:  # a directory of the length-sorted layout cannot be resumed by blocks
        meta = directory / "meta.json"
        if meta.exists() and json.loads(meta.read_text()).get("layout") != "blocks":
            raise UserError(f"{directory} holds data of a run without --budget-minutes; pass another --data-dir")
        directory.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"model": lm.name, "max_new_tokens": max_new_tokens, "layout": "blocks",
                                    "block_prompts": BLOCK_PROMPTS}, indent=1))

    def save() -> None:
        plan_file.write_text(json.dumps(plan, indent=1))

    files = [load_train_prompts(p) for p in prompts]
    order = block_order([len(rows) for rows in files])
    rows_of = lambda b: files[b[0]][b[1] * BLOCK_PROMPTS:(b[1] + 1) * BLOCK_PROMPTS]  # noqa: E731
    done = lambda b: (directories[b[0]] / "train" / f"shard-{b[1]:04d}.npz").exists()  # noqa: E731
    encode = lambda rows: {r["id"]: lm.encode_chat(row_messages(r)) for r in rows}  # noqa: E731

    if "data_batch" not in plan:
        if data_batch == "auto":
            begin = clock()
            table = measure_batches(lm, list(encode(rows_of(order[0])).values()))
            plan["data_batch"], plan["batch_table"] = pick_batch(table), {str(b): round(v, 1) for b, v in table.items()}
            plan["batch_measure_s"] = round(clock() - begin, 1)
            log(batch_table_line(table, plan["data_batch"], plan["batch_measure_s"]))
        else:
            plan["data_batch"] = data_batch
        save()
    batch = plan["data_batch"]
    plan.setdefault("data", {"tokens": 0, "seconds": 0.0})

    def distil(block, on_batch=None) -> float:
        begin = clock()
        tokens = distil_block(lm, rows_of(block), encode(rows_of(block)), directories[block[0]], block[1],
                              batch, max_new_tokens, on_batch)
        seconds = clock() - begin
        plan["data"] = {"tokens": plan["data"]["tokens"] + tokens, "seconds": round(plan["data"]["seconds"] + seconds, 2)}
        save()
        return seconds

    sizes = [len(rows_of(b)) for b in order]
    planning = "blocks" not in plan  # this run makes the plan (a resumed run finishes the kept one)
    measured = [0, 0.0]  # prompts, seconds distilled by this run: the rate the plan goes by
    if planning:  # measure on the first block still to do, then plan the rest
        first = next((i for i, b in enumerate(order) if not done(b)), len(order))
        rate = float("inf")
        if first < len(order):
            measured = [sizes[first], distil(order[first])]
            rate = measured[0] / measured[1]
            first += 1
        plan["blocks"] = plan_blocks(budget_s, clock() - started, sizes, first, rate)
        plan["first_block_prompts_per_s"] = round(rate, 3) if rate != float("inf") else None
        save()
        planned = sum(sizes[:plan["blocks"]])
        log(f"plan: distil {planned} of {sum(sizes)} prompts at {rate:.2f} prompts/s (batch {batch}, measured on "
            f"the first block) ~ {planned / rate / 60 if rate else 0:.1f} of {budget_minutes:g} min; train in the "
            f"rest less {reserve_seconds(budget_s):.0f} s for the held-out evaluation and saving")
    pending = [b for b in order[:plan["blocks"]] if not done(b)]
    bar = Progress(sum(len(rows_of(b)) for b in pending), "distill", "prompt", log=log, enabled=bool(pending))
    t_data, tokens = clock(), [0]

    def on_batch(prompts_done: int, new_tokens: int) -> None:
        tokens[0] += new_tokens
        bar.set_postfix(tok_s=f"{tokens[0] / max(clock() - t_data, 1e-9):.1f}")
        bar.update(prompts_done)

    i = 0
    while i < plan["blocks"]:
        if not done(order[i]):
            measured = [measured[0] + sizes[i], measured[1] + distil(order[i], on_batch)]
            if planning:  # re-plan at the rate so far: a block slower than the first shrinks the plan
                blocks = plan_blocks(budget_s, clock() - started, sizes, i + 1, measured[0] / measured[1])
                if blocks != plan["blocks"]:
                    bar.set_total(bar.total + sum(sizes[plan["blocks"]:blocks]) - sum(sizes[blocks:plan["blocks"]]))
                    log(f"re-plan: distil {sum(sizes[:blocks])} prompts at {measured[0] / measured[1]:.2f} "
                        "prompts/s so far")
                    plan["blocks"] = blocks
                    save()
        i += 1
    bar.close()

    train, valid = _existing_split(directories, "train", log), _existing_split(directories, "valid", log)
    train, valid = usable_splits(prompts, train, valid, log)
    reserve = reserve_seconds(budget_s)
    if "train" not in plan:
        begin = clock()
        probe = train_head(lm, train, replace(cfg, max_steps=PROBE_STEPS + 2, max_minutes=None),
                           log=lambda *_: None, progress=False)
        left = budget_s - (clock() - started) - reserve
        per_epoch = max(1, len(Windows(train, cfg.draft_length)) // cfg.batch_size)
        steps, epochs = plan_training(left, probe.steps_per_s, per_epoch)
        plan["train"] = {"steps": steps, "epochs": round(epochs, 6), "steps_per_s_probe": round(probe.steps_per_s, 3),
                         "probe_s": round(clock() - begin, 1)}
        save()
        log(f"plan: train {steps} steps ({epochs:.2f} epochs of {per_epoch}) at {probe.steps_per_s:.2f} steps/s "
            f"in the {left / 60:.1f} min left")
    left_min = max(0.05, (budget_s - (clock() - started) - reserve) / 60)
    cfg = replace(cfg, epochs=plan["train"]["epochs"], max_minutes=left_min)
    stats = dict(plan["data"], batch=batch)
    return train_and_save(lm, train, valid, Path(output), Path(checkpoint_dir), cfg, max_new_tokens, started,
                          stats, measure_k=False, log=log, extra={"budget": plan})
