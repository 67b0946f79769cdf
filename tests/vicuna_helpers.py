"""Vicuna as its official repos ship it, tiny: a sentencepiece `tokenizer.model` trained here (as
Llama's was: BPE, byte fallback, digits split, whitespace kept as written, identity normalization,
a dummy prefix; <unk>, <s>, </s> at 0, 1, 2), `pytorch_model-0000N-of-00002.bin` shards made by real
torch (tests/fixtures/torch_ckpt/vicuna_spm/, apar_spm/: make_fixtures.py), and Vicuna v1.5's
tokenizer_config.json and special_tokens_map.json (no chat template, no tokenizer.json)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

FIX = Path(__file__).parent / "fixtures" / "torch_ckpt"
SPM_VOCAB = 384  # as make_fixtures.py's SPM_VOCAB: the fixtures' vocab_size

WORDS = ("a chat between curious user and an artificial intelligence assistant the gives helpful detailed polite "
         "answers to questions why is sky blue light scatters in air short wavelengths more than long ones so we "
         "see it everywhere hello world USER ASSISTANT: what how when where who which please thank you yes no "
         "maybe café naïve déjà vu 東京 日本語 emoji 🙂 numbers 2024 3.14 tab\tsep code def print(x) return x + 1"
         ).split(" ")

# Vicuna v1.5's (lmsys/vicuna-7b-v1.5) tokenizer files, as that repo ships them
_TOKEN = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
VICUNA_TOKENIZER_CONFIG = {
    "add_bos_token": True, "add_eos_token": False,
    "bos_token": {"__type": "AddedToken", "content": "<s>", **_TOKEN},
    "clean_up_tokenization_spaces": False,
    "eos_token": {"__type": "AddedToken", "content": "</s>", **_TOKEN},
    "legacy": False, "model_max_length": 4096, "pad_token": None, "padding_side": "right", "sp_model_kwargs": {},
    "tokenizer_class": "LlamaTokenizer",
    "unk_token": {"__type": "AddedToken", "content": "<unk>", **_TOKEN},
}
VICUNA_SPECIAL_TOKENS_MAP = {name: {"content": content, **_TOKEN}
                             for name, content in (("bos_token", "<s>"), ("eos_token", "</s>"), ("unk_token", "<unk>"))}


def corpus(lines: int = 300, seed: int = 0) -> str:
    r = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [r.choice(WORDS) for _ in range(r.randint(4, 14))]
        out.append(" ".join(words).capitalize() + r.choice([".", "?", "!", ""]))
    return "\n".join(out) + "\n"


def train_tokenizer_model(directory: Path, vocab_size: int = SPM_VOCAB) -> Path:
    """Train a Llama-style sentencepiece model on a few hundred lines: `directory`/tokenizer.model."""
    import sentencepiece as spm

    directory.mkdir(parents=True, exist_ok=True)
    text = directory / "corpus.txt"
    text.write_text(corpus(), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(directory / "tokenizer"), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        add_dummy_prefix=True, character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=2)
    text.unlink()
    (directory / "tokenizer.vocab").unlink()
    return directory / "tokenizer.model"


def vicuna_dir(path: Path, fixture: str = "vicuna_spm", tokenizer_config: bool = True,
               tokenizer_model: Path = None) -> Path:
    """A copy of a fixture's weights with a trained `tokenizer.model` (and, with `tokenizer_config`,
    Vicuna's tokenizer_config.json and special_tokens_map.json)."""
    shutil.copytree(FIX / fixture, path)
    if tokenizer_model is None:
        train_tokenizer_model(path)
    else:
        shutil.copy(tokenizer_model, path / "tokenizer.model")
    if tokenizer_config:
        (path / "tokenizer_config.json").write_text(json.dumps(VICUNA_TOKENIZER_CONFIG, indent=2))
        (path / "special_tokens_map.json").write_text(json.dumps(VICUNA_SPECIAL_TOKENS_MAP, indent=2))
    return path
