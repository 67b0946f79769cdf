"""`mlx-specdec train-apar`: teach a model to fork (APAR) with LoRA and two new tokens.

Corpus (`answers.py`): the model's own greedy answers to the training prompt files. Each answer is decoded to text and run through the
extraction rules (`extract.py`): ordered lists and paragraphs become paragraph trees; code, math,
URLs and ambiguous markup are unstructured negatives (one node, no fork), sampled 1:1 with the
structured ones (with replacement when there are fewer); other answers are not used. An answer
cut off by the length cap keeps only its complete part.

Layout (`--layout`):

- `tree` (default): one packed sequence per answer: the prompt, the root stream (details replaced
  by [Fork]) and EOS, then every child: [Child], its stream, EOS. A tree mask lets every token
  see only its root path, positions are depths, and each token's target is the next token of its
  own thread ([Child] is never a target; the [Fork] predicts the parent's next sibling). Every
  token is computed once.
- `skeleton`: for a skeleton adapter (`apar/adapter.py`): only the root stream (prompt, the root's
  text with [Fork] where each detail was, EOS), one causal sequence, with the LoRA gate on from
  the first [Fork]. Children are the base model at decode time, so they need no training data;
  before the first fork the logits are the base's and the loss only teaches the [Fork] row when
  to fire (and when not: negatives are all gate 0).
- `streams`: the reference trainer's format: one sequence per stream (the root's; and per child
  the root path up to its [Fork], then [Child] and the child's stream), loss masked up to [Child].
  The same targets in the same contexts, so the same loss; but each child recomputes its prefix.

Loss (`--kl-weight`): with 0, cross-entropy on every target (the reference). With w > 0, only the
control decisions keep hard labels: targets that are [Fork] or EOS, and the first token after a
[Fork] or [Child]. Every other position learns the frozen base model's own next-token
distribution (w x KL(base || adapted), base = the same forward with the LoRA scale at 0), reading
the thread's root path as plain text: the control tokens are hidden from it and take no position
(`teacher_log_probs`), so a child's teacher is the base model continuing `... 4. Stay active:`.
Hard labels on the text teach the tuned model to write *the data* in contexts the
base never saw (a child without its siblings), which moves its greedy text away from the base's.
The KL term brings the adapted distribution much closer to the base's, but the answers' NLL under
the base barely moves, so the shipped adapter is still the cross-entropy one (see
docs/decisions.md).

Only the LoRA matrices and the two token rows train (AdamW; the rows with their own learning
rate). Checkpoints (trainable weights + optimizer + step) resume with exactly the same batches.
`--init-adapter` starts from a saved adapter (same LoRA settings) instead of zero LoRA.
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
from .adapter import prepare_for_training, save_adapter, trainable_weights
from .answers import ensure_answers, load_answers
from .config import WEIGHTS_FILE, LoraSettings, read_adapter_config
from .evaluate import evaluate
from .losses import sequence_loss, set_lora_gate, soft_positions, teacher_log_probs
from .samples import TreeSample, build_samples, collate, epoch_samples, lora_gates, make_batches
from .tokens import ControlTokens, control_tokens_for


@dataclass
class AparTrainConfig:
    rank: int = 8
    scale: float = 20.0
    lora_layers: int = -1  # last N blocks get LoRA; -1 = all
    lr: float = 2e-4  # LoRA
    rows_lr: float = 2e-3  # the [Fork]/[Child] rows
    warmup: float = 0.05
    weight_decay: float = 0.0
    epochs: float = 1.0
    tokens_per_batch: int = 2048  # padded tokens per step
    negative_ratio: float = 1.0  # unstructured answers per structured one
    layout: str = "tree"  # "tree" | "streams"
    seed: int = 0
    checkpoint_every: int = 20
    max_steps: Optional[int] = None
    compile: bool = False
    kl_weight: float = 0.0  # > 0: text positions learn the base model's distribution (see above)
    init_adapter: Optional[str] = None  # start from this adapter's weights


# -- training ----------------------------------------------------------------------------------

def lr_schedule(peak: float, warmup: float, total: int):
    warm = max(1, int(warmup * total))
    return optim.join_schedules(
        [optim.linear_schedule(peak / warm, peak, warm),
         optim.cosine_decay(peak, max(1, total - warm), peak * 0.05)], [warm])


def _is_row(path: str, _weight=None) -> bool:
    return path.endswith("extra")


def make_optimizer(cfg: AparTrainConfig, total: int):
    rows = optim.Adam(learning_rate=lr_schedule(cfg.rows_lr, cfg.warmup, total))
    lora = optim.AdamW(learning_rate=lr_schedule(cfg.lr, cfg.warmup, total), weight_decay=cfg.weight_decay)
    return optim.MultiOptimizer([rows, lora], [_is_row])


def _save_checkpoint(path: Path, model, opt, step: int, meta: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    arrays = {f"model.{k}": v for k, v in trainable_weights(model).items()}
    arrays.update({f"opt.{k}": v for k, v in tree_flatten(opt.state) if isinstance(v, mx.array)})
    tmp = path / "checkpoint.tmp.safetensors"
    mx.save_safetensors(str(tmp), arrays)
    tmp.rename(path / "checkpoint.safetensors")
    (path / "checkpoint.json").write_text(json.dumps(dict(meta, step=step), indent=1))


def _restore_optimizer(opt, saved: dict) -> None:
    """Put saved state back into the optimizer's own state dicts (MultiOptimizer's `state` is a
    fresh view on its optimizers' states, so updating that view would be lost)."""
    states = opt.state["states"] if "states" in opt.state else [opt.state]
    saved_states = saved["states"] if "states" in saved else [saved]
    for state, loaded in zip(states, saved_states):
        state.update(loaded)


def _load_checkpoint(path: Path):
    if not (path / "checkpoint.safetensors").exists() or not (path / "checkpoint.json").exists():
        return None
    try:
        return json.loads((path / "checkpoint.json").read_text()), mx.load(str(path / "checkpoint.safetensors"))
    except Exception as exc:
        raise UserError(f"corrupt APAR checkpoint in {path} ({type(exc).__name__}); delete it to start over") from None


@dataclass
class TrainResult:
    steps: int
    losses: List[float] = field(default_factory=list)
    tokens: int = 0  # padded tokens processed this run
    wall_s: float = 0.0


def plan_batches(samples: Sequence[TreeSample], cfg: AparTrainConfig) -> List[List[int]]:
    """Every step's batch, a fixed function of the samples and the seed (so a resume matches)."""
    batches: List[List[int]] = []
    epochs = int(math.ceil(cfg.epochs))
    for epoch in range(epochs):
        rng = np.random.default_rng(cfg.seed * 1000 + epoch)
        batches += make_batches(samples, epoch_samples(samples, cfg.negative_ratio, rng), cfg.tokens_per_batch, rng)
    per_epoch = len(batches) / max(epochs, 1)
    return batches[: max(1, int(round(cfg.epochs * per_epoch)))]


def train_adapter(model: nn.Module, samples: Sequence[TreeSample], cfg: AparTrainConfig,
                  checkpoint_dir: Optional[Path] = None, log: Callable[[str], None] = print,
                  progress: bool = True, control: Optional[ControlTokens] = None,
                  eos_ids: Sequence[int] = ()) -> TrainResult:
    from tqdm import tqdm

    if cfg.kl_weight > 0 and (control is None or not eos_ids):
        raise ValueError("kl_weight > 0 needs the control tokens and EOS ids (which targets stay hard)")
    if cfg.layout == "skeleton" and (cfg.kl_weight > 0 or cfg.compile):
        raise UserError("--layout skeleton trains without --kl-weight and --compile (the base text is not trained)")

    batches = plan_batches(samples, cfg)
    total = len(batches)
    opt = make_optimizer(cfg, total)
    opt.init(model.trainable_parameters())
    step = 0
    same = {k: v for k, v in asdict(cfg).items() if k not in ("max_steps", "checkpoint_every", "compile")}
    meta = {"train": same, "total_steps": total, "samples": len(samples)}
    if checkpoint_dir is not None:
        loaded = _load_checkpoint(Path(checkpoint_dir))
        if loaded is not None:
            ck_meta, arrays = loaded
            if ck_meta.get("train") != same or ck_meta.get("samples") != len(samples):
                raise UserError(f"checkpoint in {checkpoint_dir} was made with other settings or data; "
                                "delete it or pass the same options")
            model.load_weights([(k[6:], v) for k, v in arrays.items() if k.startswith("model.")], strict=False)
            _restore_optimizer(opt, tree_unflatten([(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")]))
            step = int(ck_meta["step"])
            log(f"resumed from {checkpoint_dir} at step {step}/{total}")
    mx.eval(model.parameters(), opt.state)

    loss_and_grad = nn.value_and_grad(model, sequence_loss)

    def train_step(*batch):
        loss, grads = loss_and_grad(model, *batch)
        opt.update(model, grads)
        return loss

    if cfg.compile:
        state = [model.state, opt.state]
        train_step = mx.compile(train_step, inputs=state, outputs=state)

    stop = total if cfg.max_steps is None else min(total, cfg.max_steps)
    result = TrainResult(step)
    t0 = time.perf_counter()
    bar = tqdm(total=stop, initial=step, desc="train-apar", unit="step", disable=not progress, mininterval=2)
    try:
        while step < stop:
            batch = [samples[i] for i in batches[step]]
            arrays = collate(batch)
            set_lora_gate(model, lora_gates(batch, arrays[0].shape[1]))
            loss = train_step(*arrays, *_distillation_inputs(model, batch, arrays, cfg, control, eos_ids))
            mx.eval(loss, model.trainable_parameters(), opt.state)
            step += 1
            result.steps = step
            result.losses.append(loss.item())  # host sync: one per step, for the progress bar
            result.tokens += int(arrays[0].size)
            elapsed = time.perf_counter() - t0
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(result.losses[-10:]):.3f}",
                            tok_s=f"{result.tokens / elapsed:.0f}", refresh=False)
            if checkpoint_dir is not None and (step % cfg.checkpoint_every == 0 or step == stop):
                _save_checkpoint(Path(checkpoint_dir), model, opt, step, meta)
    finally:
        bar.close()
        set_lora_gate(model, None)
    result.wall_s = time.perf_counter() - t0
    return result


def _distillation_inputs(model, batch, arrays, cfg: AparTrainConfig, control, eos_ids) -> tuple:
    """(teacher, soft, kl_weight) for sequence_loss, or () for plain cross-entropy."""
    if cfg.kl_weight <= 0:
        return ()
    tokens, _, _, rows, cols, targets = arrays
    teacher = teacher_log_probs(model, batch, arrays, control)  # host sync: a separate graph, so
    # the LoRA scale can go back before the training step is built
    return teacher, soft_positions(tokens, rows, cols, targets, control, eos_ids), cfg.kl_weight


def load_initial_adapter(model: nn.Module, config, directory: Path) -> None:
    """Put a saved adapter's weights into a freshly prepared model (same base, same LoRA shape)."""
    saved = read_adapter_config(directory)
    if saved.base_model != config.base_model or saved.tokenizer_hash != config.tokenizer_hash:
        raise UserError(f"{directory} was trained for {saved.base_model}, not {config.base_model}")
    if saved.lora != config.lora:
        raise UserError(f"{directory} has LoRA {saved.lora}; pass the same --rank/--scale/--lora-layers")
    weights = mx.load(str(Path(directory) / WEIGHTS_FILE))
    expected = trainable_weights(model)
    if set(weights) != set(expected):
        raise UserError(f"{directory}: adapter weights do not match this model's trainable weights")
    model.load_weights([(k, v.astype(expected[k].dtype)) for k, v in weights.items()], strict=False)
    mx.eval(model.parameters())


# -- the whole pipeline ------------------------------------------------------------------------

def run_train_apar(lm, prompt_files: Sequence[Path], data_dir: Path, output: Path, checkpoint_dir: Path,
                   cfg: AparTrainConfig, log: Callable[[str], None] = print) -> Dict[str, object]:
    t0 = time.perf_counter()
    ensure_answers(lm, prompt_files, data_dir, log=log)
    answers = load_answers(lm, prompt_files, data_dir)
    lora = LoraSettings(rank=cfg.rank, scale=cfg.scale, num_layers=cfg.lora_layers)
    skeleton = cfg.layout == "skeleton"
    adapted, adapter_config = prepare_for_training(lm, lora, seed=cfg.seed, mode="skeleton" if skeleton else "full")
    if cfg.init_adapter:
        load_initial_adapter(adapted.model, adapter_config, Path(cfg.init_adapter))
        log(f"starting from the adapter in {cfg.init_adapter}")
    control = control_tokens_for(adapted)
    eos_ids = sorted(lm.eos_token_ids)
    train_answers = [a for a in answers if a.split == "train"]
    valid_answers = [a for a in answers if a.split == "valid"]
    train, train_counts = build_samples(adapted, train_answers, control, cfg.layout)
    valid, valid_counts = build_samples(adapted, valid_answers, control, "skeleton" if skeleton else "tree")
    report: Dict[str, object] = {"data": {
        "data_dir": str(data_dir), "prompt_files": [str(p) for p in prompt_files],
        "train_answers": len(train_answers), "valid_answers": len(valid_answers),
        "train_kinds": train_counts, "valid_kinds": valid_counts,
        "train_samples": len(train), "train_tokens": int(sum(len(s) for s in train)),
        "mean_forks_per_structured_answer": round(float(np.mean(
            [s.forks for s in train if s.kind in ("list", "paragraphs") and cfg.layout in ("tree", "skeleton")] or [0])), 2),
    }}
    log("data: " + json.dumps(report["data"]))
    if cfg.kl_weight > 0 or cfg.init_adapter:
        report["valid_at_start"] = evaluate(adapted.model, valid, control, eos_ids=() if skeleton else eos_ids)
        log("validation at start: " + json.dumps(report["valid_at_start"]))
    result = train_adapter(adapted.model, train, cfg, checkpoint_dir=checkpoint_dir, log=log,
                           control=control, eos_ids=eos_ids)
    report["train"] = {"config": asdict(cfg), "steps": result.steps, "total_steps": len(plan_batches(train, cfg)),
                       "wall_s_this_run": round(result.wall_s, 1),
                       "padded_tokens_per_s": round(result.tokens / result.wall_s, 1) if result.wall_s else None,
                       "loss_first_10": round(float(np.mean(result.losses[:10])), 4) if result.losses else None,
                       "loss_last_10": round(float(np.mean(result.losses[-10:])), 4) if result.losses else None,
                       "trainable_params": int(sum(v.size for v in trainable_weights(adapted.model).values()))}
    report["valid"] = evaluate(adapted.model, valid, control, eos_ids=() if skeleton else eos_ids)
    log("validation: " + json.dumps(report["valid"]))
    save_adapter(adapted.model, adapter_config, output)
    report["size_bytes"] = sum(p.stat().st_size for p in Path(output).iterdir() if p.is_file())
    report["wall_s_total_this_run"] = round(time.perf_counter() - t0, 1)
    (Path(output) / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {output} ({report['size_bytes'] / 1e6:.1f} MB)")
    return report
