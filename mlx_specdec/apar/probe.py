"""A fork probe: the original model decides the first [Fork], so an answer that never forks is its own.

With a full APAR adapter the LoRA changes every token, also in answers that never fork (code,
math): their text drifts from the original model's (a clearly higher NLL under it).
A fork probe keeps the original model in charge until the first fork:

- the root thread decodes with the *original* weights (the prompt too); the [Fork] logit is read
  off its final hidden state by one linear row, `f = h . w + b`, next to the original vocabulary's
  logits (greedy forks where f beats every token's logit);
- at the first [Fork] the adapted model (LoRA fused) takes over for every thread, as in the
  full mode. The prompt and the text before the fork keep the original model's KV.

So an answer that never forks is the original model's greedy answer token for token, and the
text before the first fork is too.

The row is trained on the original model's own greedy answers (the same shards as the adapter):
every answer flattened, the hidden state at each position, and a target that is the answer's next
token or, where the paper's extraction rules put a fork (every fork point of the tree, so a probe
that misses the first one can still fork at the next), [Fork]. The loss is the cross-entropy over
the original vocabulary plus the one new logit, with the vocabulary's logits frozen: only w and b
learn (577 numbers). Answers the rules do not use ("none") and the unstructured ones are
negatives: the probe learns where the rules would fork, not just where lists start.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UserError
from ..model.forward import forward
from .answers import load_answers
from .config import CONFIG_FILE, check_adapter, read_adapter_config
from .extract import complete_part, extract
from .tree import Fork, ParagraphTree

PROBE_FILE = "fork_probe.safetensors"
PROBE_REPORT = "fork_probe.json"


@dataclass
class ForkProbe:
    """The original model plus its [Fork] row. `model` is the un-adapted base model."""

    model: nn.Module
    weight: mx.array  # (D,)
    bias: mx.array  # () scalar

    def fork_logit(self, hidden: mx.array) -> mx.array:
        """hidden (..., D) final-norm states -> (...) [Fork] logits."""
        return hidden.astype(mx.float32) @ self.weight + self.bias

    def logits_with_control(self, hidden: mx.array, logits: mx.array) -> mx.array:
        """(N, V) base logits -> (N, V + 2): [Fork] = the probe, [Child] = -inf (never sampled).
        The adapter's ids are V and V + 1 (project convention: `adapter._control_for`)."""
        logits = logits.astype(mx.float32)
        child = mx.full((logits.shape[0], 1), -float("inf"), dtype=mx.float32)
        return mx.concatenate([logits, self.fork_logit(hidden)[:, None], child], axis=-1)


def save_fork_probe(directory: Path, weight: mx.array, bias: mx.array, report: dict) -> None:
    directory = Path(directory)
    mx.save_safetensors(str(directory / PROBE_FILE),
                        {"weight": weight.astype(mx.float32), "bias": mx.reshape(bias, (1,)).astype(mx.float32)})
    (directory / PROBE_REPORT).write_text(json.dumps(report, indent=1) + "\n")


def load_fork_probe(directory: Path, base_model: nn.Module) -> Optional[ForkProbe]:
    """The probe shipped next to a (project-convention) adapter, whose [Fork], [Child] ids are
    the vocabulary size and the next one; None if there is none. One-line errors on a bad file."""
    path = Path(directory) / PROBE_FILE
    if not path.exists():
        return None
    try:
        arrays = mx.load(str(path))
        weight, bias = arrays["weight"], arrays["bias"]
    except Exception as exc:
        raise UserError(f"corrupt fork probe {path}: {type(exc).__name__}") from None
    width = int(base_model.model.norm.weight.shape[0])  # the final norm's width = the hidden size
    if weight.shape != (width,) or bias.shape != (1,):
        raise UserError(f"corrupt fork probe {path}: weight {tuple(weight.shape)}, bias {tuple(bias.shape)}; "
                        f"this model's hidden size is {width}")
    return ForkProbe(base_model, weight.astype(mx.float32), bias[0].astype(mx.float32))


# -- training data -------------------------------------------------------------------------------

def flatten_with_forks(tree: ParagraphTree) -> Tuple[List[int], List[int]]:
    """(answer tokens in reading order, the indices i after whose token i a fork comes; -1 = before
    the first token). A token tree's restore, remembering where each fork marker was."""
    tokens: List[int] = []
    forks: List[int] = []

    def walk(thread: int) -> None:
        for piece in tree.streams[thread]:
            if isinstance(piece, Fork):
                forks.append(len(tokens) - 1)
                walk(piece.child)
            else:
                tokens.append(piece)

    walk(0)
    return tokens, forks


@dataclass
class ProbeExample:
    """One answer: features at every position that predicts an answer token (or the EOS)."""

    hidden: np.ndarray  # (T, D) float16: final-norm states
    lse: np.ndarray  # (T,) float32: logsumexp of the base logits
    target_logit: np.ndarray  # (T,) float32: the base logit of the answer's next token
    max_logit: np.ndarray  # (T,) float32: the largest base logit
    fork: np.ndarray  # (T,) bool: the rules fork here
    kind: str
    split: str


def answer_example(lm, prompt: Sequence[int], text: str, finished: bool, split: str) -> Optional[ProbeExample]:
    text = complete_part(text, finished)
    extraction = extract(text)
    tokenizer = lm.tokenizer
    if extraction.tree is None:
        tokens, forks, kind = list(tokenizer.encode(text, add_special_tokens=False)), [], extraction.kind
    else:
        tree = extraction.tree.map(lambda piece: list(tokenizer.encode(piece, add_special_tokens=False)))
        (tokens, forks), kind = flatten_with_forks(tree), extraction.kind
    if not tokens:
        return None
    if finished:
        tokens = tokens + [min(lm.eos_token_ids)]
    ids = list(prompt) + tokens
    first = len(prompt) - 1  # the position whose logits predict tokens[0]
    out = forward(lm.model, mx.array(ids)[None], None, logits_for="all")
    hidden = out.hidden[0, first:len(ids) - 1]  # (T, D)
    logits = out.logits[0, first:len(ids) - 1].astype(mx.float32)  # (T, V)
    targets = mx.array(tokens)
    lse = mx.logsumexp(logits, axis=-1)
    target_logit = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    max_logit = logits.max(axis=-1)
    mx.eval(hidden, lse, target_logit, max_logit)
    fork = np.zeros(len(tokens), bool)
    fork[[f + 1 for f in forks]] = True  # a fork after token i is predicted where token i+1 is
    return ProbeExample(np.array(hidden.astype(mx.float16)), np.array(lse), np.array(target_logit),
                        np.array(max_logit), fork, kind, split)


def collect_examples(lm, answers, cache_file: Path, log: Callable[[str], None] = print) -> List[ProbeExample]:
    """Features of every answer (the base model's forward over each), cached in one .npz."""
    cache_file = Path(cache_file)
    fingerprint = answers_fingerprint(answers)
    if cache_file.exists():
        try:
            z = np.load(cache_file, allow_pickle=False)
            meta = json.loads(str(z["meta"]))
            if meta.get("fingerprint") == fingerprint and meta.get("model") == lm.name:
                return _unpack(z, meta)
        except (OSError, KeyError, ValueError):
            pass  # unreadable or from an older layout: computed again below
        log(f"{cache_file} holds other answers' features: computing them again")
    from tqdm import tqdm

    examples = []
    t0 = time.perf_counter()
    for answer in tqdm(answers, desc="fork probe features", unit="answer"):
        example = answer_example(lm, answer.prompt, answer.text, answer.finished, answer.split)
        if example is not None:
            examples.append(example)
    log(f"features of {len(examples)} answers in {time.perf_counter() - t0:.0f} s")
    _pack(examples, cache_file, {"answers": len(answers), "model": lm.name, "fingerprint": fingerprint})
    return examples


def answers_fingerprint(answers) -> str:
    """crc32 of the extraction rules' source (`extract.py`) and of every answer's prompt id, split,
    finish and text: a cache made from other data or other rules is never reused."""
    import zlib

    crc = zlib.crc32(Path(__file__).with_name("extract.py").read_bytes())
    for a in answers:
        crc = zlib.crc32(f"{a.prompt_id}\x00{a.split}\x00{a.finished}\x00{a.text}\x01".encode(), crc)
    return f"{len(answers)}-{crc:08x}"


def _pack(examples: List[ProbeExample], path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = np.array([len(e.fork) for e in examples])
    meta = dict(meta, kinds=[e.kind for e in examples], splits=[e.split for e in examples])
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, lengths=lengths, hidden=np.concatenate([e.hidden for e in examples]),
             lse=np.concatenate([e.lse for e in examples]),
             target_logit=np.concatenate([e.target_logit for e in examples]),
             max_logit=np.concatenate([e.max_logit for e in examples]),
             fork=np.concatenate([e.fork for e in examples]), meta=json.dumps(meta))
    tmp.replace(path)


def _unpack(z, meta: dict) -> List[ProbeExample]:
    bounds = np.concatenate([[0], np.cumsum(z["lengths"])])
    fields = {k: z[k] for k in ("hidden", "lse", "target_logit", "max_logit", "fork")}
    return [ProbeExample(*(fields[k][a:b] for k in ("hidden", "lse", "target_logit", "max_logit", "fork")),
                         kind, split)
            for a, b, kind, split in zip(bounds[:-1], bounds[1:], meta["kinds"], meta["splits"])]


# -- training and evaluation ---------------------------------------------------------------------

def probe_loss(weight, bias, hidden, lse, target_logit, fork, fork_weight: float = 1.0):
    """Mean cross-entropy over (V base logits, frozen) + (the [Fork] logit f = h.w + b).

        log Z     = logaddexp(lse, f)                  the softmax normaliser with the new logit
        loss_fork = log Z - f                          where the rules fork
        loss_text = log Z - logit(next answer token)   everywhere else
    """
    f = hidden @ weight + bias  # (T,)
    log_z = mx.logaddexp(lse, f)
    per_position = log_z - mx.where(fork, f, target_logit)
    weights = mx.where(fork, fork_weight, 1.0)
    return (per_position * weights).sum() / weights.sum()


def train_probe(examples: Sequence[ProbeExample], steps: int = 400, lr: float = 1e-2, l2: float = 1e-4,
                fork_weight: float = 1.0, log: Callable[[str], None] = print) -> Tuple[mx.array, mx.array, List[float]]:
    """Full-batch Adam on the train split. Returns (weight (D,), bias (), losses)."""
    import mlx.optimizers as optim

    train = [e for e in examples if e.split == "train"]
    if not train or not any(e.fork.any() for e in train):
        raise UserError("the fork probe needs training answers with at least one fork point "
                        f"({len(train)} training answers)")
    hidden = mx.array(np.concatenate([e.hidden for e in train]).astype(np.float32))
    lse = mx.array(np.concatenate([e.lse for e in train]))
    target_logit = mx.array(np.concatenate([e.target_logit for e in train]))
    fork = mx.array(np.concatenate([e.fork for e in train]))
    params = {"weight": mx.zeros((hidden.shape[1],)), "bias": mx.array(-10.0)}  # start: never fork

    def loss_fn(p):
        return probe_loss(p["weight"], p["bias"], hidden, lse, target_logit, fork, fork_weight) \
            + l2 * (p["weight"] ** 2).sum()

    opt = optim.Adam(learning_rate=lr)
    step_fn = mx.value_and_grad(loss_fn)
    losses = []
    for step in range(steps):
        loss, grads = step_fn(params)
        params = opt.apply_gradients(grads, params)
        mx.eval(params, loss)
        losses.append(float(loss.item()))
        if step % 100 == 0 or step == steps - 1:
            log(f"probe step {step}: loss {losses[-1]:.4f}")
    return params["weight"], params["bias"], losses


def evaluate_probe(weight: mx.array, bias: mx.array, examples: Sequence[ProbeExample], split: str) -> Dict[str, object]:
    """How the greedy decision (fork where f > the largest base logit) does on one split:

    - per fork point: recall (it forks there) and precision over positions where it fires;
    - per answer, as decoding meets it (the base writes the flattened answer until the first
      fire): does the first fire land on a fork point of a structured answer, and do the
      negatives (unstructured, none) never fire?
    """
    chosen = [e for e in examples if e.split == split]
    w, b = np.array(weight, np.float32), float(np.array(bias))
    hits = fires = points = 0
    first_right = structured = negatives_fired = negatives = 0
    for e in chosen:
        fired = (e.hidden.astype(np.float32) @ w + b) > e.max_logit
        hits += int((fired & e.fork).sum())
        fires += int(fired.sum())
        points += int(e.fork.sum())
        first = int(np.argmax(fired)) if fired.any() else -1
        if e.kind in ("list", "paragraphs"):
            structured += 1
            first_right += int(first >= 0 and bool(e.fork[first]))
        else:
            negatives += 1
            negatives_fired += int(first >= 0)
    return {"split": split, "answers": len(chosen), "fork_points": points,
            "recall": round(hits / max(points, 1), 4), "precision": round(hits / max(fires, 1), 4),
            "structured_answers": structured, "first_fire_on_a_fork_point": first_right,
            "negative_answers": negatives, "negatives_that_fire": negatives_fired}


def run_train_probe(lm, adapter_dir: Path, prompt_files: Sequence[Path], data_dir: Path, cache_file: Path,
                    steps: int = 400, lr: float = 1e-2, fork_weight: float = 1.0,
                    log: Callable[[str], None] = print) -> dict:
    t0 = time.perf_counter()
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / CONFIG_FILE).exists():
        raise UserError(f"{adapter_dir}: no APAR adapter there (the probe is saved next to one)")
    config = read_adapter_config(adapter_dir)
    check_adapter(config, lm, where=f"APAR adapter {adapter_dir}")  # the probe reads this model's states
    if config.mode != "full":
        raise UserError(f"{adapter_dir}: a fork probe goes with a full adapter, not a skeleton one")
    answers = load_answers(lm, prompt_files, data_dir)
    examples = collect_examples(lm, answers, cache_file, log=log)
    weight, bias, losses = train_probe(examples, steps=steps, lr=lr, fork_weight=fork_weight, log=log)
    kinds: Dict[str, int] = {}
    for e in examples:
        kinds[f"{e.split}/{e.kind}"] = kinds.get(f"{e.split}/{e.kind}", 0) + 1
    report = {
        "model": lm.name, "dtype": lm.dtype, "bits": lm.bits,
        "data": {"data_dir": str(data_dir), "prompt_files": [str(p) for p in prompt_files],
                 "answers": kinds, "positions": int(sum(len(e.fork) for e in examples if e.split == "train")),
                 "fork_points": int(sum(e.fork.sum() for e in examples if e.split == "train"))},
        "train": {"steps": steps, "lr": lr, "fork_weight": fork_weight, "loss_first": round(losses[0], 4),
                  "loss_last": round(losses[-1], 4)},
        "train_eval": evaluate_probe(weight, bias, examples, "train"),
        "valid": evaluate_probe(weight, bias, examples, "valid"),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    save_fork_probe(adapter_dir, weight, bias, report)
    log("fork probe: " + json.dumps(report["valid"]))
    return report
