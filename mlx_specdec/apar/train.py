"""`mlx-specdec train-apar`: teach a model to fork (APAR) with LoRA and two new tokens.

Corpus: the model's own greedy answers to the training prompt files (the same shards the
ReDrafter distillation writes: `<data-dir>/<prompt file stem>/{train,valid}/shard-*.npz`, token
ids per answer; generated if missing). Each answer is decoded to text and run through the
extraction rules (`extract.py`): ordered lists and paragraphs become paragraph trees; code, math,
URLs and ambiguous markup are unstructured negatives (one node, no fork), sampled 1:1 with the
structured ones (with replacement when there are fewer); other answers are not used. An answer
cut off by the length cap keeps only its complete part.

Layout (the measured choice, `--layout`):

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
base never saw (a child without its siblings), which moved its greedy text away from the base's
(measured: 85% argmax agreement on held-out answers after the first adapter). The KL term cut
the held-out KL to the base 4-6x, but the answers' NLL under the base barely moved (measured:
models/apar-smollm2-135m/CARD.md), so the shipped adapter is still the cross-entropy one.

Only the LoRA matrices and the two token rows train (AdamW; the rows with their own learning
rate). Checkpoints (trainable weights + optimizer + step) resume with exactly the same batches.
`--init-adapter` starts from a saved adapter (same LoRA settings) instead of zero LoRA.
"""

from __future__ import annotations

import json
import math
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .. import masks
from ..errors import UserError
from ..model.forward import forward, lm_head
from .adapter import LoraSettings, prepare_for_training, save_adapter, trainable_weights
from .extract import Extraction, complete_part, extract
from .tokens import ControlTokens, control_tokens_for
from .tree import Fork, ParagraphTree


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


# -- corpus ------------------------------------------------------------------------------------

@dataclass
class Answer:
    prompt_id: str
    prompt: List[int]  # chat-template token ids
    text: str
    finished: bool
    split: str  # "train" | "valid"
    source: str  # prompt file stem
    shape: str = ""


def default_data_dir(lm) -> Path:
    from ..model.default import home

    slug = "smollm2-135m" if lm.name.startswith("SmolLM2-135M-Instruct") else re.sub(r"[^\w.-]+", "-", lm.name)
    return home() / "drafter-data" / slug


def ensure_answers(lm, prompt_files: Sequence[Path], data_dir: Path, max_new_tokens: int = 192,
                   batch_size: int = 32, log: Callable[[str], None] = print) -> None:
    """Reuse the greedy-answer shards if present (made by this model); generate missing ones."""
    from ..drafter.data import DataConfig, generate_data

    for prompt_file in prompt_files:
        directory = Path(data_dir) / Path(prompt_file).stem
        meta = directory / "meta.json"
        if meta.exists():
            made_by = json.loads(meta.read_text()).get("model")
            if made_by != lm.name:
                raise UserError(f"{directory} holds answers of {made_by!r}, not {lm.name!r}: pass another --data-dir")
        if list((directory / "train").glob("shard-*.npz")) and not _missing_shards(directory):
            continue
        log(f"generating the model's greedy answers to {prompt_file} into {directory}")
        generate_data(lm, DataConfig(prompts=Path(prompt_file), out=directory, max_new_tokens=max_new_tokens,
                                     batch_size=batch_size), log=log)


def _missing_shards(directory: Path) -> bool:
    meta = json.loads((directory / "meta.json").read_text()) if (directory / "meta.json").exists() else {}
    want = {"train": meta.get("train_prompts"), "valid": meta.get("valid_prompts")}
    for split, count in want.items():
        if count is None:
            continue
        have = 0
        for f in sorted((directory / split).glob("shard-*.npz")):
            if ".tmp" not in f.name:
                have += len(np.load(f)["prompt_ids"])
        if have < count:
            return True
    return False


def load_answers(lm, prompt_files: Sequence[Path], data_dir: Path) -> List[Answer]:
    from ..drafter.data import load_train_prompts

    eos = lm.eos_token_ids
    answers: List[Answer] = []
    for prompt_file in prompt_files:
        rows = {str(r["id"]): r for r in load_train_prompts(Path(prompt_file))}
        directory = Path(data_dir) / Path(prompt_file).stem
        for split in ("train", "valid"):
            for shard in sorted((directory / split).glob("shard-*.npz")):
                if ".tmp" in shard.name:
                    continue
                z = np.load(shard)
                tokens, offsets, ids = z["tokens"], z["offsets"], z["prompt_ids"]
                for i, pid in enumerate(ids):
                    row = rows.get(str(pid))
                    if row is None:
                        raise UserError(f"{shard} has prompt id {pid} missing from {prompt_file}")
                    answer = [int(t) for t in tokens[offsets[i]:offsets[i + 1]]]
                    finished = bool(answer) and answer[-1] in eos
                    if finished:
                        answer = answer[:-1]
                    answers.append(Answer(str(pid), lm.encode_chat([{"role": "user", "content": row["prompt"]}]),
                                          lm.tokenizer.decode(answer), finished, split,
                                          Path(prompt_file).stem, row.get("shape", "")))
    if not answers:
        raise UserError(f"no answers under {data_dir}")
    return answers


# -- packed trees ------------------------------------------------------------------------------

@dataclass
class TreeSample:
    """One answer laid out for training. parents[i]: the previous token on i's root path."""

    tokens: np.ndarray  # (L,) int32
    parents: np.ndarray  # (L,) int32, -1 for the first prompt token
    targets: np.ndarray  # (L,) int32, -1 = no loss
    kind: str
    forks: int
    prompt_len: int
    answer: int = -1  # index of the answer it came from
    gate_from: int = -1  # skeleton layout: LoRA on for tokens from this index on; -1: on everywhere

    def __len__(self) -> int:
        return len(self.tokens)


def token_tree(extraction: Extraction, tokenizer) -> ParagraphTree:
    """The text tree with every piece tokenised on its own (as a thread would write it)."""
    return extraction.tree.map(lambda piece: list(tokenizer.encode(piece, add_special_tokens=False)))


def layout_tree(prompt: Sequence[int], tree: ParagraphTree, control: ControlTokens, eos: int,
                kind: str = "") -> TreeSample:
    tokens: List[int] = list(prompt)
    parents: List[int] = [i - 1 for i in range(len(prompt))]
    targets: List[int] = [-1] * len(prompt)
    fork_at: Dict[int, int] = {}
    for thread in sorted(tree.threads):  # a parent is created (and numbered) before its children
        if thread == 0:
            prev, items = len(prompt) - 1, list(tree.streams[0])
        else:
            prev = fork_at[thread]
            tokens.append(control.child)
            parents.append(prev)
            targets.append(-1)
            prev = len(tokens) - 1  # [Child] is fed, never predicted
            items = list(tree.streams[thread])
        for item in items + [eos]:
            token = control.fork if isinstance(item, Fork) else item
            index = len(tokens)
            tokens.append(token)
            parents.append(prev)
            targets.append(-1)
            targets[prev] = token
            if isinstance(item, Fork):
                fork_at[item.child] = index
            prev = index
    return TreeSample(np.array(tokens, np.int32), np.array(parents, np.int32), np.array(targets, np.int32),
                      kind, len(tree.threads) - 1, len(prompt))


def layout_streams(prompt: Sequence[int], tree: ParagraphTree, control: ControlTokens, eos: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """The reference format: (tokens, targets) per stream; loss only after the stream's [Child]."""
    out = []
    for thread in sorted(tree.threads):
        path = list(prompt) + tree.root_path(thread, control.fork, control.child) + [eos]
        seq = np.array(path, np.int32)
        targets = np.full(len(seq), -1, np.int32)
        start = len(prompt) - 1 if thread == 0 else len(path) - len(tree.stream(thread, control.fork)) - 2
        targets[start:-1] = seq[start + 1:]
        out.append((seq, targets))
    return out


def layout_skeleton(prompt: Sequence[int], tree: ParagraphTree, control: ControlTokens, eos: int,
                    kind: str = "") -> TreeSample:
    """The root stream as one causal sequence: prompt + root text with [Fork]s + EOS; every answer
    token is a target; the LoRA gate opens at the first [Fork] (len when it never forks)."""
    seq = np.array(list(prompt) + tree.stream(0, control.fork) + [eos], np.int32)
    targets = np.full(len(seq), -1, np.int32)
    targets[len(prompt) - 1:-1] = seq[len(prompt):]
    forks = np.nonzero(seq == control.fork)[0]
    sample = linear_sample(seq, targets, kind)
    sample.forks, sample.prompt_len = len(forks), len(prompt)
    sample.gate_from = int(forks[0]) if len(forks) else len(seq)
    return sample


def linear_sample(tokens: np.ndarray, targets: np.ndarray, kind: str = "stream") -> TreeSample:
    parents = np.arange(len(tokens), dtype=np.int32) - 1
    return TreeSample(tokens, parents, targets, kind, 0, 0)


def build_samples(lm, answers: Sequence[Answer], control: ControlTokens,
                  layout: str = "tree") -> Tuple[List[TreeSample], Dict[str, int]]:
    eos = min(lm.eos_token_ids)
    samples: List[TreeSample] = []
    counts: Dict[str, int] = {}
    for number, answer in enumerate(answers):
        extraction = extract(complete_part(answer.text, answer.finished))
        counts[extraction.kind] = counts.get(extraction.kind, 0) + 1
        if extraction.tree is None:
            continue
        tree = token_tree(extraction, lm.tokenizer)
        if layout == "skeleton":
            samples.append(layout_skeleton(answer.prompt, tree, control, eos, extraction.kind))
            samples[-1].answer = number
        elif layout == "tree" or extraction.kind == "unstructured":
            samples.append(layout_tree(answer.prompt, tree, control, eos, extraction.kind))
            samples[-1].answer = number
        else:
            for seq, targets in layout_streams(answer.prompt, tree, control, eos):
                samples.append(linear_sample(seq, targets, extraction.kind))
                samples[-1].answer = number
    return samples, counts


# -- batches -----------------------------------------------------------------------------------

PAD_MULTIPLE = 32


def _padded(n: int) -> int:
    return int(math.ceil(n / PAD_MULTIPLE) * PAD_MULTIPLE)


def epoch_samples(samples: Sequence[TreeSample], ratio: float, rng: np.random.Generator) -> List[int]:
    """Indices for one epoch: every structured sample, and ratio x as many negatives."""
    structured = [i for i, s in enumerate(samples) if s.kind != "unstructured"]
    negatives = [i for i, s in enumerate(samples) if s.kind == "unstructured"]
    answers = len({samples[i].answer for i in structured})  # streams layout: several per answer
    want = int(round(ratio * answers))
    chosen: List[int] = list(structured)
    if negatives and want:
        reps = int(math.ceil(want / len(negatives)))
        pool = np.concatenate([rng.permutation(negatives) for _ in range(reps)])[:want]
        chosen += [int(i) for i in pool]
    return chosen


def make_batches(samples: Sequence[TreeSample], indices: Sequence[int], tokens_per_batch: int,
                 rng: np.random.Generator) -> List[List[int]]:
    """Length-sorted batches of at most tokens_per_batch padded tokens, in random order."""
    order = sorted(indices, key=lambda i: (len(samples[i]), rng.random()))
    batches, current, longest = [], [], 0
    for i in order:
        n = _padded(len(samples[i]))
        if current and max(longest, n) * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return [batches[j] for j in rng.permutation(len(batches))]


def collate(batch: Sequence[TreeSample], hide_tokens: Sequence[int] = ()):
    """(tokens (B, L), positions (B, L), mask (B, 1, L, L), rows (K,), cols (K,), targets (K,)).

    hide_tokens: ids no other token sees and that take no position (the KL teacher's view:
    the base model reads each thread's path as plain text, without [Fork]/[Child])."""
    L = _padded(max(len(s) for s in batch))
    B = len(batch)
    tokens = np.zeros((B, L), np.int32)
    positions = np.zeros((B, L), np.int32)
    mask = np.zeros((B, 1, L, L), bool)
    rows, cols, targets = [], [], []
    for b, s in enumerate(batch):
        n = len(s)
        tokens[b, :n] = s.tokens
        hidden = np.isin(s.tokens, hide_tokens) if len(hide_tokens) else None
        positions[b, :n] = masks.tree_depths_np(s.parents, hidden)
        mask[b, 0, :n, :n] = masks.tree_mask_np(s.parents, hidden)
        pads = np.arange(n, L)
        mask[b, 0, pads, pads] = True  # padding sees itself only: no empty softmax row
        where = np.nonzero(s.targets >= 0)[0]
        rows += [b] * len(where)
        cols += where.tolist()
        targets += s.targets[where].tolist()
    return (mx.array(tokens), mx.array(positions), mx.array(mask), mx.array(np.array(rows, np.int32)),
            mx.array(np.array(cols, np.int32)), mx.array(np.array(targets, np.int32)))


def lora_gates(batch: Sequence[TreeSample], length: int) -> Optional[mx.array]:
    """(B, L, 1) per-token LoRA gates of a skeleton batch (1 from each sample's `gate_from` to its
    end; padding 0), or None for a batch of ungated samples."""
    if all(s.gate_from < 0 for s in batch):
        return None
    gates = np.zeros((len(batch), length, 1), np.float32)
    for b, s in enumerate(batch):
        gates[b, max(s.gate_from, 0):len(s)] = 1.0
    return mx.array(gates)


def set_lora_gate(model: nn.Module, gates: Optional[mx.array]) -> None:
    """Set the per-token gate of a skeleton model before building a forward (no-op otherwise)."""
    gate = getattr(model, "lora_gate", None)
    if gate is not None:
        gate.value = gates


def sequence_loss(model: nn.Module, tokens, positions, mask, rows, cols, targets, teacher=None, soft=None,
                  kl_weight: float = 0.0, reduce: str = "mean"):
    """Per selected position (under the tree mask): cross-entropy with its target, or, where
    `soft` and a teacher is given, kl_weight x KL(teacher || model) over the teacher's vocabulary.

    teacher: (K, V0) log-probabilities of the base model (V0 = base vocabulary, no control tokens,
    so the adapted model also learns not to fork there); soft: (K,) bool."""
    hidden = forward(model, tokens, None, positions=positions, mask=mask, logits_for="none").hidden
    picked = hidden[rows, cols]  # (K, D): only positions with a target reach the vocabulary
    logits = lm_head(model, picked).astype(mx.float32)  # (K, V0 + 2)
    per_token = nn.losses.cross_entropy(logits, targets, reduction="none")  # (K,)
    if teacher is not None:
        per_token = mx.where(soft, kl_weight * kl_from_teacher(teacher, logits), per_token)
    return per_token.mean() if reduce == "mean" else per_token


def kl_from_teacher(teacher: mx.array, logits: mx.array) -> mx.array:
    """(K,) KL(p || q) = sum_v p_v (log p_v - log q_v), p the teacher's (K, V0) log-probs, q the
    model's softmax over (K, V0 + 2) logits: q's control-token mass counts as a miss."""
    log_q = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return (mx.exp(teacher) * (teacher - log_q[:, : teacher.shape[-1]])).sum(axis=-1)


@contextmanager
def lora_disabled(model: nn.Module):
    """The base model for the duration: every LoRA update scaled by 0 (y + 0 * z == y exactly).
    MLX records the scale when the graph is built, so arrays built inside stay the base's."""
    from mlx_lm.tuner.lora import LoRALinear

    layers = [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    scales = [m.scale for m in layers]
    for m in layers:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, scale in zip(layers, scales):
            m.scale = scale


def base_log_probs(model: nn.Module, tokens, positions, mask, rows, cols, base_vocab: int) -> mx.array:
    """(K, base_vocab) log-probabilities of the frozen base model at the selected positions."""
    with lora_disabled(model):
        hidden = forward(model, tokens, None, positions=positions, mask=mask, logits_for="none").hidden
        logits = lm_head(model, hidden[rows, cols])[:, :base_vocab].astype(mx.float32)
        teacher = mx.stop_gradient(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(teacher)
    return teacher


def soft_positions(tokens, rows, cols, targets, control: ControlTokens, eos_ids: Sequence[int]) -> mx.array:
    """(K,) True where the target is text the base model should write: not a fork or an end, and
    not the first token after [Fork] (the parent's next sibling) or [Child] (the child's start)."""
    fed = tokens[rows, cols]
    hard = (targets == control.fork) | (fed == control.fork) | (fed == control.child)
    for eos in eos_ids:
        hard = hard | (targets == eos)
    return mx.logical_not(hard)


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


def teacher_log_probs(model, batch: Sequence[TreeSample], arrays, control: ControlTokens) -> mx.array:
    """The base model's (K, V0) log-probs for the batch's targets, each thread's path read as
    plain text: [Fork]/[Child] hidden and taking no position. (Shown the control tokens, which it
    never learned, the base model writes a child's detail about the wrong item.)"""
    tokens, _, _, rows, cols, _ = arrays
    _, positions, mask, *_ = collate(batch, hide_tokens=(control.fork, control.child))
    return base_log_probs(model, tokens, positions, mask, rows, cols, min(control.fork, control.child))


def _distillation_inputs(model, batch, arrays, cfg: AparTrainConfig, control, eos_ids) -> tuple:
    """(teacher, soft, kl_weight) for sequence_loss, or () for plain cross-entropy."""
    if cfg.kl_weight <= 0:
        return ()
    tokens, _, _, rows, cols, targets = arrays
    teacher = teacher_log_probs(model, batch, arrays, control)  # host sync: a separate graph, so
    # the LoRA scale can go back before the training step is built
    return teacher, soft_positions(tokens, rows, cols, targets, control, eos_ids), cfg.kl_weight


# -- evaluation --------------------------------------------------------------------------------

def evaluate(model: nn.Module, samples: Sequence[TreeSample], control: ControlTokens,
             tokens_per_batch: int = 2048, eos_ids: Sequence[int] = ()) -> Dict[str, object]:
    """Teacher-forced: loss, and how the model's argmax treats [Fork] at true and false spots.
    With eos_ids, also how close the text stays to the base model (LoRA off) at the text
    positions (`soft_positions`): argmax agreement and mean KL(base || adapted)."""
    rng = np.random.default_rng(0)
    losses, counts = [], 0
    true_forks = hit = predicted = correct = 0
    negative_with_fork = negatives = 0
    agree = soft_count = 0
    kl_sum = 0.0
    for batch_idx in make_batches(samples, range(len(samples)), tokens_per_batch, rng):
        batch = [samples[i] for i in batch_idx]
        arrays = collate(batch)
        tokens, positions, mask, rows, cols, targets = arrays
        set_lora_gate(model, lora_gates(batch, tokens.shape[1]))
        hidden = forward(model, tokens, None, positions=positions, mask=mask, logits_for="none").hidden
        logits = lm_head(model, hidden[rows, cols]).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, targets, reduction="none")
        guess = mx.argmax(logits, axis=-1)
        if eos_ids:
            teacher = teacher_log_probs(model, batch, arrays, control)
            soft = np.array(soft_positions(tokens, rows, cols, targets, control, eos_ids))
            kl = np.array(kl_from_teacher(teacher, logits))
            same = np.array(mx.argmax(teacher, axis=-1) == guess)
            agree += int(same[soft].sum())
            soft_count += int(soft.sum())
            kl_sum += float(kl[soft].sum())
        ce, guess, t, r = (np.array(a) for a in (ce, guess, targets, rows))
        losses.append(float(ce.sum()))
        counts += len(ce)
        true_forks += int((t == control.fork).sum())
        hit += int(((t == control.fork) & (guess == control.fork)).sum())
        predicted += int((guess == control.fork).sum())
        correct += int(((guess == control.fork) & (t == control.fork)).sum())
        for b, s in enumerate(batch):
            if s.kind == "unstructured":
                negatives += 1
                negative_with_fork += int(((r == b) & (guess == control.fork)).any())
    report = {
        "samples": len(samples), "loss": round(sum(losses) / max(counts, 1), 4),
        "fork_recall": round(hit / true_forks, 4) if true_forks else None,
        "fork_precision": round(correct / predicted, 4) if predicted else None,
        "true_forks": true_forks,
        "negatives_with_a_fork": f"{negative_with_fork}/{negatives}",
    }
    if eos_ids:
        report["base_argmax_agreement"] = round(agree / max(soft_count, 1), 4)
        report["base_kl"] = round(kl_sum / max(soft_count, 1), 4)
    return report


def load_initial_adapter(model: nn.Module, config, directory: Path) -> None:
    """Put a saved adapter's weights into a freshly prepared model (same base, same LoRA shape)."""
    from .adapter import WEIGHTS_FILE, read_adapter_config

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
