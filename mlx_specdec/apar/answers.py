"""The APAR corpus: the model's own greedy answers to the training prompt files.

They are the same shards the ReDrafter distillation writes
(`<data-dir>/<prompt file stem>/{train,valid}/shard-*.npz`, token ids per answer), generated if
missing. The adapter trainer (`train.py`) and the fork-probe trainer (`probe.py`) both read them here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Sequence

import numpy as np

from ..errors import UserError


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
    from ..redrafter_head.data import DataConfig, generate_data

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
    from ..redrafter_head.data import load_train_prompts

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
