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
The cost model it reports (measured here, and a 7B 4-bit model on an M-series Mac) is cost_model.py.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Sequence, Tuple

from .cost_model import AUTO_BATCHES, pick_batch
from .progress import Progress

BLOCK_PROMPTS = 64  # prompts per distillation block (one train and at most one valid shard each)
DATA_SHARE = 0.5  # of the budget spent distilling data; training gets the rest
RESERVE_SHARE, RESERVE_MIN_S = 0.04, 30.0  # kept back for the held-out evaluation and saving
TRAIN_SAFETY = 0.95  # planned steps fill this share of the training time (the rate is a short sample)
MAX_BUDGET_EPOCHS = 8.0  # a small prompt set with a long budget stops here rather than overfit
AUTO_MAX_NEW_TOKENS = 24  # answer cap of the batch measurement: long enough to reach steady decode


# ---- batch size ---------------------------------------------------------------------------------

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
