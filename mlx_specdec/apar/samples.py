"""APAR training samples: answers laid out as packed paragraph trees (or streams), and batches.

An answer's extraction (`extract.py`) becomes a `TreeSample` in one of three layouts (the
trainer's `--layout`, see `train.py`); `collate` turns a batch into the arrays a training or
evaluation forward takes, the tree mask and depth positions built by `masks.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .. import masks
from .answers import Answer
from .extract import Extraction, complete_part, extract
from .tokens import ControlTokens
from .tree import Fork, ParagraphTree


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
