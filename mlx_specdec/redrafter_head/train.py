"""Distil a ReDrafter head from the LLM's own greedy answers (teacher forcing, frozen LLM).

For a response position i with hidden state hidden[i] (which produced tokens[i]):

    s_1 = e(tokens[i]),               logits_1 = head.logits(s_1, hidden[i])  -> tokens[i+1]
    s_k = next_state(s_{k-1}, e(tokens[i+k-1])),  logits_k                    -> tokens[i+k]

for k = 1..T (T = draft_length), cross-entropy over the draft vocabulary; targets past the end
of the answer or outside the draft vocabulary are masked out of the loss. With output="llm_head"
the head also regresses its predicted hidden state at step k onto hidden[i+k], the LLM's real
hidden state that produced tokens[i+k] (smooth L1, weight `feature_loss`), as EAGLE does. With
`soft_targets` = a > 0 the token loss is (1 - a) * that cross-entropy + a * the cross-entropy against
the LLM's whole distribution over the draft vocabulary at the target (softmax of hidden[i+k] through
the LLM's own output rows: what the data already holds, no extra forward), as EAGLE's classification
loss: the hard label says only which token won, the soft one also how close the others came.
AdamW with a linear warm-up then cosine decay. Checkpoints (head + optimizer + step) let an interrupted run resume
with exactly the same batches (the data order is a fixed function of seed and epoch).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import UserError
from .data import Sequences, keep_prompts, load_splits, training_prompt_ids
from .model import (DrafterConfig, DrafterHead, llm_output_rows, llm_shapes, load_drafter, save_drafter,
                   tokenizer_hash)
from .teacher_forcing import Windows, evaluate_head, llm_embedding_table, loss_fn
from .vocab import draft_vocabulary, measure_draft_vocab
from .cost_model import cost_lines, cost_report
from .progress import Progress


@dataclass
class TrainConfig:
    draft_vocab_size: int = 4096
    draft_length: int = 5
    num_blocks: int = 2
    batch_size: int = 256
    epochs: float = 2.0
    lr: float = 1e-3
    warmup: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0
    checkpoint_every: int = 50
    max_steps: Optional[int] = None  # stop early (for tests / partial runs)
    max_minutes: Optional[float] = None  # stop after this much training time (a lent machine's deadline)
    compile: bool = True
    output: str = "draft_vocab"  # "draft_vocab" | "llm_head" (DrafterConfig.output)
    feature_loss: float = 1.0  # weight of the hidden-state regression (output="llm_head")
    init_from: Optional[str] = None  # a saved head to go on training (its weights and draft vocabulary)
    soft_targets: float = 0.0  # weight of the LLM's soft distribution in the token loss (0 = hard labels)


def lr_schedule(cfg: TrainConfig, total_steps: int):
    warm = max(1, int(cfg.warmup * total_steps))
    return optim.join_schedules(
        [optim.linear_schedule(cfg.lr / warm, cfg.lr, warm),
         optim.cosine_decay(cfg.lr, max(1, total_steps - warm), cfg.lr * 0.01)],
        [warm])


def _save_checkpoint(path: Path, head: DrafterHead, opt, step: int, meta: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    arrays = {f"head.{k}": v for k, v in tree_flatten(head.parameters())}
    arrays.update({f"opt.{k}": v for k, v in tree_flatten(opt.state) if isinstance(v, mx.array)})
    arrays["draft_to_full"] = head.draft_to_full
    tmp = path / "checkpoint.tmp.safetensors"
    mx.save_safetensors(str(tmp), arrays)
    tmp.rename(path / "checkpoint.safetensors")
    (path / "checkpoint.json").write_text(json.dumps(dict(meta, step=step), indent=1))


def _load_checkpoint(path: Path):
    if not (path / "checkpoint.safetensors").exists() or not (path / "checkpoint.json").exists():
        return None
    try:
        meta = json.loads((path / "checkpoint.json").read_text())
        arrays = mx.load(str(path / "checkpoint.safetensors"))
    except Exception as exc:
        raise UserError(f"corrupt drafter checkpoint in {path} ({type(exc).__name__}); delete it to start over") from None
    return meta, arrays


@dataclass
class TrainResult:
    head: DrafterHead
    steps: int
    losses: List[float] = field(default_factory=list)
    wall_s: float = 0.0
    masked_fraction: float = 0.0  # of (position, draft step) targets outside the draft vocabulary
    steps_per_s: float = 0.0  # this run's steps after the first WARM_STEPS (compilation left out)


WARM_STEPS = 2  # steps left out of the step rate (the first compiles the step)


def train_head(lm, train: Sequences, cfg: TrainConfig, checkpoint_dir: Optional[Path] = None,
               draft_to_full: Optional[np.ndarray] = None, log: Callable[[str], None] = print,
               progress: bool = True) -> TrainResult:
    hidden_size, embed_size, vocab = llm_shapes(lm)
    start = load_drafter(cfg.init_from, lm) if cfg.init_from else None
    if start is not None:  # go on from a saved head: its draft vocabulary, blocks and output stay
        if start.config.output != cfg.output or start.config.num_blocks > cfg.num_blocks:
            raise UserError(f"{cfg.init_from} is a {start.config.output} head with {start.config.num_blocks} "
                            f"blocks; pass the same --output-kind and at least as many --blocks")
        draft_to_full = np.array(start.draft_to_full)
        grown = cfg.num_blocks - start.config.num_blocks
        log(f"going on from {cfg.init_from}: its {len(draft_to_full)}-token draft vocabulary"
            + (f", {grown} more block(s) starting as the identity" if grown else "")
            + f", a fresh optimizer and learning-rate schedule (peak {cfg.lr:g})")
    if draft_to_full is None:
        eos = sorted(lm.eos_token_ids)
        draft_to_full = draft_vocabulary(train.tokens, cfg.draft_vocab_size, vocab, always=eos)
    config = DrafterConfig(llm_hidden_size=hidden_size, embed_size=embed_size, vocab_size=vocab,
                           draft_vocab_size=len(draft_to_full), num_blocks=cfg.num_blocks,
                           draft_length=cfg.draft_length, model_name=lm.name,
                           tokenizer_hash=tokenizer_hash(lm.tokenizer), output=cfg.output)
    mx.random.seed(cfg.seed)

    def new_head(d2f) -> DrafterHead:
        head = DrafterHead(config, d2f)
        if config.output == "llm_head":
            head.attach_output_rows(llm_output_rows(lm, head.draft_to_full))
        return head

    head = new_head(draft_to_full)
    if start is not None:
        head.load_weights(grown_weights(start, head), strict=True)
    windows = Windows(train, cfg.draft_length)
    per_epoch = max(1, len(windows) // cfg.batch_size)
    total = max(1, int(math.ceil(cfg.epochs * per_epoch)))
    opt = optim.AdamW(learning_rate=lr_schedule(cfg, total), weight_decay=cfg.weight_decay)
    opt.init(head.trainable_parameters())
    step = 0
    # settings that must match for a resume (a resumed run may stop elsewhere or save more often)
    # (init_from and soft_targets only where set: checkpoints written before them still resume)
    same = {k: v for k, v in asdict(cfg).items() if k not in ("max_steps", "max_minutes", "checkpoint_every", "compile")
            and not (k == "init_from" and v is None) and not (k == "soft_targets" and not v)}
    meta = {"train": same, "total_steps": total, "windows": len(windows)}
    if checkpoint_dir is not None:
        loaded = _load_checkpoint(Path(checkpoint_dir))
        if loaded is not None:
            ck_meta, arrays = loaded
            if ck_meta.get("train") != meta["train"] or ck_meta.get("windows") != len(windows):
                raise UserError(f"checkpoint in {checkpoint_dir} was made with other settings or data; "
                                "delete it or pass the same options")
            head = new_head(arrays["draft_to_full"])
            head.load_weights([(k[5:], v) for k, v in arrays.items() if k.startswith("head.")])
            opt_state = tree_unflatten([(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")])
            opt.state.update(opt_state)
            step = int(ck_meta["step"])
            log(f"resumed from {checkpoint_dir} at step {step}/{total}")
    mx.eval(head.parameters(), opt.state)
    embed_table = llm_embedding_table(lm)

    # fraction of targets the draft vocabulary cannot express (reported, masked from the loss)
    targets = train.tokens[(windows.positions[:, None] + np.arange(1, cfg.draft_length + 1))
                           .clip(max=len(train.tokens) - 1)]
    tvalid = (windows.positions[:, None] + np.arange(1, cfg.draft_length + 1)) < windows.ends[windows.positions][:, None]
    outside = ~np.isin(targets, np.array(head.draft_to_full))
    masked_fraction = float((outside & tvalid).sum() / max(1, tvalid.sum()))

    loss_and_grad = nn.value_and_grad(head, loss_fn)
    teacher_rows = None
    if cfg.soft_targets:  # the LLM's own output rows of the draft vocabulary (frozen)
        teacher_rows = head._output_rows if config.output == "llm_head" else llm_output_rows(lm, head.draft_to_full)

    def train_step(toks, valid, hidden, following, teacher_rows=None):
        loss, grads = loss_and_grad(head, embed_table, toks, valid, hidden, following, cfg.feature_loss,
                                    teacher_rows, cfg.soft_targets)
        opt.update(head, grads)
        return loss

    if cfg.compile:
        state = [head.state, opt.state]
        train_step = mx.compile(train_step, inputs=state, outputs=state)

    def order(epoch: int) -> np.ndarray:
        return np.random.default_rng(cfg.seed * 1000 + epoch).permutation(windows.positions)

    stop = total if cfg.max_steps is None else min(total, cfg.max_steps)
    losses: List[float] = []
    t0 = time.perf_counter()
    bar = Progress(stop, "train", "step", initial=step, enabled=progress, log=log)
    first, t_warm = step, None
    epoch_cache = (-1, None)
    try:
        while step < stop:
            if cfg.max_minutes is not None and time.perf_counter() - t0 > 60 * cfg.max_minutes:
                log(f"stopped at step {step}/{total} after {cfg.max_minutes:g} min (resume with the same options)")
                if checkpoint_dir is not None:  # so that a resume goes on from exactly here
                    _save_checkpoint(Path(checkpoint_dir), head, opt, step, meta)
                break
            epoch, within = divmod(step, per_epoch)
            if epoch_cache[0] != epoch:
                epoch_cache = (epoch, order(epoch))
            pos = epoch_cache[1][within * cfg.batch_size:(within + 1) * cfg.batch_size]
            loss = train_step(*windows.batch(pos), *([teacher_rows] if cfg.soft_targets else []))
            mx.eval(loss, head.state, opt.state)
            step += 1
            if step - first == WARM_STEPS:
                t_warm = time.perf_counter()
            losses.append(loss.item())  # host sync: one per step, for the progress bar
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", lr=f"{float(opt.learning_rate):.1e}")
            if checkpoint_dir is not None and (step % cfg.checkpoint_every == 0 or step == stop):
                _save_checkpoint(Path(checkpoint_dir), head, opt, step, meta)
    finally:
        bar.close()
    end = time.perf_counter()
    rate = (step - first - WARM_STEPS) / (end - t_warm) if t_warm is not None and end > t_warm else 0.0
    return TrainResult(head, step, losses, end - t0, masked_fraction, rate)


def grown_weights(start: DrafterHead, head: DrafterHead):
    """`start`'s weights for `head`, which may have more residual blocks: each extra block starts at
    zero, and g + SiLU(0 g + 0) = g, so the grown head computes exactly what `start` did and
    training decides what the new blocks add (their gradient at zero is SiLU'(0) g = g / 2)."""
    weights = {k: mx.zeros_like(v) for k, v in tree_flatten(head.parameters())}
    weights.update(tree_flatten(start.parameters()))
    return list(weights.items())


def run_pipeline(lm, prompts: Sequence[Path], data_dir: Path, output: Path, checkpoint_dir: Path,
                 cfg: TrainConfig, max_new_tokens: int = 192, data_batch=32,
                 measure_k: bool = True, log: Callable[[str], None] = print,
                 data_only: bool = False, generate: bool = True,
                 started: Optional[float] = None) -> Dict[str, object]:
    """Distillation data (resumable) -> K measurement -> training (resumable) -> eval -> save.
    data_batch: an int, or a callable that measures it when there is data to generate.
    data_only: stop after the data (a long generation run, resumed later, trains nothing).
    generate=False: train on the shards already there (a data run stopped part-way).
    started: the command's start (time.perf_counter()), for the total time in the cost report."""
    from .data import DataConfig, generate_data

    t0 = time.perf_counter() if started is None else started
    directories = [Path(data_dir) / Path(p).stem for p in prompts]  # one data directory per prompt file
    stats: Dict[str, float] = {}
    if generate:
        for prompt_file, directory in zip(prompts, directories):
            generate_data(lm, DataConfig(prompts=Path(prompt_file), out=directory,
                                         max_new_tokens=max_new_tokens, batch_size=data_batch), log=log,
                          stats=stats)
        train, valid = load_splits(directories, "train"), load_splits(directories, "valid")
    else:  # a stopped data run: whatever shards each directory has
        train, valid = _existing_split(directories, "train", log), _existing_split(directories, "valid", log)
        if train is None:
            raise UserError(f"no distillation shards under {data_dir} for these prompt files; "
                            "run the data step first (without --no-generate)")
    train, valid = usable_splits(prompts, train, valid, log)
    if data_only:
        return {"data": {"train_tokens": int(len(train.tokens)), "valid_tokens": int(len(valid.tokens))}}
    return train_and_save(lm, train, valid, output, checkpoint_dir, cfg, max_new_tokens, t0, stats,
                          measure_k=measure_k, log=log)


def usable_splits(prompts: Sequence[Path], train: Sequences, valid: Optional[Sequences], log):
    """The splits without answers to prompts that nearly copy a bench prompt (or left their file)."""
    usable = training_prompt_ids(prompts)
    train, valid = (_only_current_prompts(seqs, usable, log) for seqs in (train, valid))
    log(f"data: {len(train.offsets) - 1} train answers / {len(train.tokens)} tokens, "
        + (f"{len(valid.offsets) - 1} valid answers / {len(valid.tokens)} tokens" if valid is not None else "no valid answers"))
    return train, valid


def train_and_save(lm, train: Sequences, valid: Optional[Sequences], output: Path, checkpoint_dir: Path,
                   cfg: TrainConfig, max_new_tokens: int, started: float, data_stats: Dict,
                   measure_k: bool = True, log: Callable[[str], None] = print,
                   extra: Optional[Dict] = None) -> Dict[str, object]:
    """K measurement -> training (resumable) -> eval -> save, with training.json (the data, the
    training, the held-out figures, the cost model, and `extra`: e.g. the budget plan)."""
    report: Dict[str, object] = {"data": {
        "train_answers": len(train.offsets) - 1, "train_tokens": int(len(train.tokens)),
        "valid_answers": len(valid.offsets) - 1 if valid is not None else 0,
        "valid_tokens": int(len(valid.tokens)) if valid is not None else 0,
        "valid_prompt_ids": [_json_id(i) for i in valid.prompt_ids] if valid is not None else [],
        "max_new_tokens": max_new_tokens}}
    report.update(extra or {})
    if measure_k and valid is not None and not cfg.init_from:  # (a head to go on from brings its K)
        report["draft_vocab"] = measure_draft_vocab(lm, train, valid)
        log("draft vocabulary: " + json.dumps(report["draft_vocab"]["by_k"]))
    result = train_head(lm, train, cfg, checkpoint_dir=checkpoint_dir, log=log)
    report["train"] = {"config": asdict(cfg), "steps": result.steps,
                       "wall_s_this_run": round(result.wall_s, 1),
                       "steps_per_s": round(result.steps_per_s, 3),
                       "masked_target_fraction": round(result.masked_fraction, 4),
                       "final_loss_mean_last_50": round(float(np.mean(result.losses[-50:])), 4) if result.losses else None,
                       "params": result.head.num_params()}
    report["valid"] = evaluate_head(result.head, lm, valid) if valid is not None else None
    log("validation: " + (json.dumps(report["valid"]) if valid is not None else "no held-out shards yet"))
    save_drafter(result.head, output)
    report["size_bytes"] = sum(p.stat().st_size for p in Path(output).iterdir() if p.is_file())
    report["wall_s_total_this_run"] = round(time.perf_counter() - started, 1)
    hidden_size, embed_size, _ = llm_shapes(lm)
    tokens = int(len(train.tokens)) + (int(len(valid.tokens)) if valid is not None else 0)
    answers = len(train.offsets) - 1 + (len(valid.offsets) - 1 if valid is not None else 0)
    report["cost"] = cost_report(data_stats, result, cfg, tokens, tokens / max(1, answers), hidden_size,
                                 embed_size, len(result.head.draft_to_full), report["wall_s_total_this_run"])
    for line in cost_lines(report["cost"]):
        log(line)
    (Path(output) / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {output} ({report['size_bytes'] / 1e6:.1f} MB)")
    return report


def _json_id(prompt_id):
    """A prompt id for the report: numeric ids as numbers, others (a follow-up turn's
    "<id>+followup") as they are. Ids of several prompt files concatenate to strings."""
    text = str(prompt_id)
    return int(text) if text.lstrip("-").isdigit() else text


def _only_current_prompts(seqs: Optional[Sequences], usable_ids: Sequence, log) -> Optional[Sequences]:
    if seqs is None:
        return None
    kept = keep_prompts(seqs, usable_ids)
    if len(kept.prompt_ids) < len(seqs.prompt_ids):
        log(f"left out {len(seqs.prompt_ids) - len(kept.prompt_ids)} answers: their prompts nearly copy "
            "a bench prompt or are no longer in the prompt files")
    return kept


def _existing_split(directories: Sequence[Path], split: str, log: Callable[[str], None]) -> Optional[Sequences]:
    """One split over the directories that have shards of it (None if none has)."""
    present = [d for d in directories if any((d / split).glob("shard-[0-9]*[0-9].npz"))]
    for d in directories:
        if d not in present:
            log(f"{d}: no {split} shards yet, left out")
    return load_splits(present, split) if present else None
