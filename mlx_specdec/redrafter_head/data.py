"""Distillation data for the ReDrafter head: the LLM's own greedy answers and hidden states.

For every training prompt (chat template; one user message, or a conversation whose last user turn
is answered) the LLM answers greedily (up to
`max_new_tokens` (default 192), stopping at EOS). Prompts run in batches: left-padded, with per-row
positions and a boolean mask (True = attend) that hides pad keys and is causal, over one
`ContiguousKVCache` of batch B. The final-norm hidden state of each step is kept as it is
produced, so no second pass is needed:

    tokens[i]  the i-th response token (the LLM's greedy choice)
    hidden[i]  the hidden state that predicted tokens[i] (at the previous position)

So `hidden[i]` and `tokens[i]` are exactly what the drafter sees at inference: the LLM's last
hidden state and the token it produced from it; the head then predicts tokens[i+1:i+1+T].

Shards (`shard-XXXX.npz`: tokens int32 concatenated, hidden float16 concatenated, offsets,
prompt ids) go under `<out>/train` and `<out>/valid`; finished shards are skipped on restart.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .. import masks
from ..cache.contiguous import ContiguousKVCache
from ..errors import UserError
from ..model.forward import forward
from .progress import Progress

VALID_FRACTION = 0.05


def load_train_prompts(path: Path) -> List[dict]:
    path = Path(path)
    if not path.exists():
        raise UserError(f"no prompt file {path}")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n} is not valid JSON") from None
        if "prompt" not in row and not _is_conversation(row.get("messages")):
            raise UserError(f"{path}:{n} has no 'prompt' field and no 'messages' "
                            "(a list of {role, content} that ends with the user's turn)")
        row.setdefault("id", n)
        rows.append(row)
    return rows


def _is_conversation(messages) -> bool:
    return (isinstance(messages, list) and bool(messages)
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user", "assistant")
                    for m in messages)
            and messages[-1]["role"] == "user")


def row_messages(row: dict) -> List[dict]:
    """A training row as chat messages: one user turn, or a whole conversation (multi-turn rows,
    data/make_followups.py) whose last turn the LLM answers."""
    return row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]


def is_validation(prompt_id, fraction: float = VALID_FRACTION) -> bool:
    """A fixed ~5% of prompt ids (by a hash of the id, so it never depends on the file order)."""
    return (zlib.crc32(str(prompt_id).encode()) % 1000) < int(fraction * 1000)


def word_ngrams(text: str, n: int = 3) -> set:
    words = "".join(c.lower() if c.isalnum() else " " for c in text).split()
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def near_copies(texts: Sequence[str], references: Sequence[str], threshold: float = 0.5,
                n: int = 3) -> List[Tuple[str, str, float]]:
    """(text, reference, Jaccard) for every text whose word n-grams overlap a reference's by at
    least `threshold`: a training prompt that nearly copies a benchmark prompt would let the head
    memorise the answer the bench then measures."""
    refs = [(r, word_ngrams(r, n)) for r in references]
    found = []
    for t in texts:
        grams = word_ngrams(t, n)
        for r, rgrams in refs:
            score = len(grams & rgrams) / len(grams | rgrams)
            if score >= threshold:
                found.append((t, r, round(score, 3)))
    return found


def batched_greedy(lm, prompts: Sequence[List[int]], max_new_tokens: int) -> List[Tuple[List[int], np.ndarray]]:
    """Greedy-decode B prompts together. Returns per prompt (response ids, hidden (n, D) float16).

    The response stops after the first EOS (included) or at max_new_tokens.
    """
    model = lm.model
    eos = lm.eos_token_ids
    B = len(prompts)
    P = max(len(p) for p in prompts)
    pads = [P - len(p) for p in prompts]
    tokens = mx.array([[0] * pad + list(p) for pad, p in zip(pads, prompts)], dtype=mx.int32)  # (B, P)
    pad = mx.array(pads, dtype=mx.int32)[:, None]  # (B, 1)
    idx = mx.arange(P, dtype=mx.int32)[None, :]  # (1, P)
    positions = mx.maximum(idx - pad, 0)  # (B, P)
    key_real = np.arange(P)[None, :] >= np.array(pads)[:, None]  # (B, P) not padding
    mask = masks.padded_causal_mask(key_real, 0, P)  # (B, 1, P, P): pad queries see themselves
    cache = ContiguousKVCache.for_model(model)
    out = forward(model, tokens, cache, positions=positions, mask=mask, logits_for="last")
    hidden = out.hidden[:, -1, :]  # (B, D)
    next_tok = mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)  # (B,)
    mx.eval(next_tok, hidden)

    responses: List[List[int]] = [[] for _ in range(B)]
    hiddens: List[List[np.ndarray]] = [[] for _ in range(B)]
    done = [False] * B
    rows = list(range(B))  # batch row -> prompt index; finished rows are dropped from the batch
    next_pos = mx.array([len(p) for p in prompts], dtype=mx.int32)[:, None]  # (B, 1)
    extra = 0  # generated keys in the cache so far
    for step in range(max_new_tokens):
        toks_host = np.array(next_tok)  # host sync: one per step, to record tokens and stop at EOS
        hid_host = np.array(hidden.astype(mx.float16))
        for j, b in enumerate(rows):
            responses[b].append(int(toks_host[j]))
            hiddens[b].append(hid_host[j])
            if int(toks_host[j]) in eos:
                done[b] = True
        if all(done) or step == max_new_tokens - 1:
            break
        if any(done[b] for b in rows):  # drop finished rows from the cache and the batch
            keep = [j for j, b in enumerate(rows) if not done[b]]
            keep_arr = mx.array(keep, dtype=mx.int32)
            for layer in cache.layers:
                layer.keys = layer.keys[keep_arr]
                layer.values = layer.values[keep_arr]
            rows = [rows[j] for j in keep]
            key_real, next_tok, next_pos = key_real[keep], next_tok[keep_arr], next_pos[keep_arr]
        n = len(rows)
        extra += 1
        keys = np.concatenate([key_real, np.ones((n, extra), dtype=bool)], axis=1)  # (n, P + extra)
        step_mask = masks.padded_causal_mask(keys, keys.shape[1] - 1, keys.shape[1])  # (n, 1, 1, keys)
        out = forward(model, next_tok[:, None], cache, positions=next_pos + step,
                      mask=step_mask, logits_for="last")
        hidden = out.hidden[:, -1, :]
        next_tok = mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)
        mx.async_eval(next_tok, hidden)
    return [(r, np.stack(h).astype(np.float16)) for r, h in zip(responses, hiddens)]


@dataclass
class DataConfig:
    prompts: Path
    out: Path
    max_new_tokens: int = 192
    batch_size: object = 32  # an int, or a callable that measures it (--data-batch auto)
    shard_prompts: int = 32  # prompts per shard file
    limit: Optional[int] = None


def _shards(rows: List[dict], size: int) -> List[List[dict]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def generate_data(lm, cfg: DataConfig, log=print, stats: Optional[Dict] = None) -> Dict[str, int]:
    """Generate (or resume) the distillation shards. Returns token counts per split. `cfg.batch_size`
    may be a callable that gives it, called only when there is something to generate (so that
    `--data-batch auto` measures nothing on a finished data directory). `stats` gains this run's
    new tokens, seconds and batch size."""
    rows = load_train_prompts(cfg.prompts)
    if cfg.limit:
        rows = rows[: cfg.limit]
    enc = {}
    for r in rows:
        enc[r["id"]] = lm.encode_chat(row_messages(r))
    splits = {"train": [r for r in rows if not is_validation(r["id"])],
              "valid": [r for r in rows if is_validation(r["id"])]}
    cfg.out.mkdir(parents=True, exist_ok=True)
    meta_file = cfg.out / "meta.json"
    if meta_file.exists():  # resuming: the shards keep the size they were cut with
        shard_prompts = json.loads(meta_file.read_text()).get("shard_prompts", 32)
    else:  # a batch never spans shards: a shard holds at least one batch
        shard_prompts = max(cfg.shard_prompts, cfg.batch_size if isinstance(cfg.batch_size, int) else 64)
    meta_file.write_text(json.dumps({
        "model": lm.name, "prompts": str(cfg.prompts), "max_new_tokens": cfg.max_new_tokens,
        "shard_prompts": shard_prompts,
        "train_prompts": len(splits["train"]), "valid_prompts": len(splits["valid"]),
        "valid_ids": [r["id"] for r in splits["valid"]],
    }, indent=1))
    counts = {}
    todo = []
    for split, srows in splits.items():
        (cfg.out / split).mkdir(exist_ok=True)
        # sort by prompt length inside the split so batches pad little
        srows = sorted(srows, key=lambda r: len(enc[r["id"]]))
        shards = _shards(srows, shard_prompts)
        for i, shard in enumerate(shards):
            todo.append(((i + 0.5) / len(shards), split, cfg.out / split / f"shard-{i:04d}.npz", shard))
    # The splits are interleaved in proportion (a valid shard after every ~20 train shards), so a run
    # stopped part-way (hours of generation) already has held-out answers to measure a head on.
    todo = [t[1:] for t in sorted(todo, key=lambda t: t[0])]
    pending = [t for t in todo if not t[1].exists()]
    log(f"{len(todo)} shards, {len(todo) - len(pending)} already done")
    batch_size = (cfg.batch_size() if callable(cfg.batch_size) else cfg.batch_size) if pending else 0
    bar = Progress(sum(len(t[2]) for t in pending), "distill", "prompt", log=log, enabled=bool(pending))
    new_tokens, t0 = 0, time.perf_counter()
    for split, path, shard in pending:
        results = []
        for batch in _shards(shard, batch_size):
            results += batched_greedy(lm, [enc[r["id"]] for r in batch], cfg.max_new_tokens)
            new_tokens += sum(len(r[0]) for r in results[-len(batch):])
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.1f}")
            bar.update(len(batch))
        write_shard(path, shard, results, enc)
    bar.close()
    for split in splits:
        counts[split] = sum(int(np.load(p)["offsets"][-1]) for p in sorted((cfg.out / split).glob("shard-*.npz")))
    seconds = time.perf_counter() - t0
    log(f"new tokens this run: {new_tokens} in {seconds:.0f} s; totals {counts}")
    if stats is not None:
        stats.update(tokens=stats.get("tokens", 0) + new_tokens, seconds=stats.get("seconds", 0.0) + seconds,
                     batch=batch_size)
    return counts


def write_shard(path: Path, rows: List[dict], results, enc: Dict, width: int = 0) -> None:
    """One shard file, written under a temporary name and renamed (a shard that exists is whole).
    `results` are batched_greedy's (response ids, hidden) for `rows`, in order; `width` the hidden
    size, for a shard with no rows."""
    lengths = [len(r[0]) for r in results]
    width = results[0][1].shape[1] if results else width
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp,
             tokens=np.concatenate([np.zeros(0, np.int32)] + [np.array(r[0], np.int32) for r in results]),
             hidden=np.concatenate([np.zeros((0, width), np.float16)] + [r[1] for r in results]),
             offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
             prompt_ids=np.array([r["id"] for r in rows]),
             prompt_lengths=np.array([len(enc[r["id"]]) for r in rows], np.int32))
    tmp.rename(path)


def distil_block(lm, rows: List[dict], enc: Dict, directory: Path, index: int, batch_size: int,
                 max_new_tokens: int, on_batch=None) -> int:
    """Distil one block of prompts (`train-drafter --budget-minutes`): answered in batches by prompt
    length; its held-out rows (by the id hash) go to valid/shard-<index>.npz if it has any, the rest to
    train/shard-<index>.npz, written last so that it marks the block done. `on_batch(prompts, tokens)`
    after each batch. Returns the new tokens."""
    rows = sorted(rows, key=lambda r: len(enc[r["id"]]))
    results = []
    for batch in _shards(rows, batch_size):
        results += batched_greedy(lm, [enc[r["id"]] for r in batch], max_new_tokens)
        if on_batch is not None:
            on_batch(len(batch), sum(len(r[0]) for r in results[-len(batch):]))
    width = results[0][1].shape[1]
    for split in ("valid", "train"):
        picked = [(r, res) for r, res in zip(rows, results) if is_validation(r["id"]) == (split == "valid")]
        if picked or split == "train":
            (directory / split).mkdir(parents=True, exist_ok=True)
            write_shard(directory / split / f"shard-{index:04d}.npz", [r for r, _ in picked],
                        [res for _, res in picked], enc, width)
    return sum(len(r[0]) for r in results)


@dataclass
class Sequences:
    """All responses of one split: tokens (N,) int32, hidden (N, D) float16, offsets (S+1,)."""
    tokens: np.ndarray
    hidden: np.ndarray
    offsets: np.ndarray
    prompt_ids: np.ndarray


def load_split(directory: Path, split: str) -> Sequences:
    files = sorted((Path(directory) / split).glob("shard-*.npz"))
    files = [f for f in files if ".tmp" not in f.name]
    if not files:
        raise UserError(f"no distillation shards in {Path(directory) / split}; run the data step first")
    toks, hids, offs, pids = [], [], [0], []
    for f in files:
        try:
            z = np.load(f)
            t, h, o, p = z["tokens"], z["hidden"], z["offsets"], z["prompt_ids"]
        except Exception as exc:
            raise UserError(f"corrupt data shard {f}: {type(exc).__name__}") from None
        toks.append(t)
        hids.append(h)
        offs += list(offs[-1] + o[1:])
        pids.append(p)
    return Sequences(np.concatenate(toks), np.concatenate(hids), np.array(offs, np.int64), np.concatenate(pids))


def load_splits(directories: Sequence[Path], split: str) -> Sequences:
    """One split over several data directories (one per prompt file), concatenated."""
    parts = [load_split(d, split) for d in directories]
    offsets, base = [np.zeros(1, np.int64)], 0
    for part in parts:
        offsets.append(part.offsets[1:] + base)
        base += len(part.tokens)
    return Sequences(np.concatenate([p.tokens for p in parts]), np.concatenate([p.hidden for p in parts]),
                     np.concatenate(offsets), np.concatenate([p.prompt_ids for p in parts]))


BENCH_FILES = ("prompts.jsonl", "chat_unseen.jsonl")  # what `mlx-specdec bench` measures the head on


def bench_questions(root: Path = Path(__file__).resolve().parents[2]) -> List[str]:
    """Every turn of the project's bench prompt files (none in an install without benchmarks/)."""
    return [turn for name in BENCH_FILES if (root / "benchmarks" / name).exists()
            for line in (root / "benchmarks" / name).read_text().splitlines() if line.strip()
            for turn in json.loads(line).get("turns", [])]


def training_prompt_ids(prompt_files: Sequence[Path], bench: Optional[Sequence[str]] = None) -> List:
    """Ids of the rows of `prompt_files` that training may use: none of a row's user turns nearly
    copies a bench prompt (the files are left as they are so that a stopped data run resumes with
    the same shards; the few near copies are generated, then left out here)."""
    bench = bench_questions() if bench is None else bench
    ids = []
    for path in prompt_files:
        for row in load_train_prompts(path):
            turns = [m["content"] for m in row_messages(row) if m["role"] == "user"]
            if not near_copies(turns, bench):
                ids.append(row["id"])
    return ids


def keep_prompts(seqs: Sequences, prompt_ids) -> Sequences:
    """Only the answers whose prompt id is in `prompt_ids` (compared as text): a prompt taken out of
    its file (e.g. a near copy of a bench prompt) takes its generated answer out of training too."""
    wanted = {str(i) for i in prompt_ids}
    keep = [j for j, pid in enumerate(seqs.prompt_ids) if str(pid) in wanted]
    if len(keep) == len(seqs.prompt_ids):
        return seqs
    spans = [np.arange(seqs.offsets[j], seqs.offsets[j + 1]) for j in keep]
    index = np.concatenate(spans) if spans else np.zeros(0, np.int64)
    lengths = [seqs.offsets[j + 1] - seqs.offsets[j] for j in keep]
    return Sequences(seqs.tokens[index], seqs.hidden[index],
                     np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), seqs.prompt_ids[keep])

