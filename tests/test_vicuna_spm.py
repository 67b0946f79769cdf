"""Vicuna as its users get it, tiny: a Llama directory with PyTorch `.bin` shards, a sentencepiece
`tokenizer.model` and no tokenizer.json, no chat template (tests/vicuna_helpers.py).

- The tokenizer encodes as sentencepiece itself does: `encode(s)` is BOS (id 1, as Llama's tokenizer
  adds it; sentencepiece's own `encode` adds none) followed by `SentencePieceProcessor.encode(s)`,
  whitespace runs, leading spaces, unicode and byte fallback included, and decoding round-trips.
  (transformers 5's own LlamaTokenizer drops the dummy prefix of a text that starts with a space,
  and of the text after the chat template's BOS; the loader rebuilds it: loader.sentencepiece_tokenizer.)
- With no chat template the prompt is Vicuna v1.1's conversation, token for token as FastChat
  builds it: BOS, then sentencepiece's encoding of "SYSTEM USER: ... ASSISTANT:".
- `generate` answers with every method; greedy `mlx-lm`, `redrafter` (no head: prompt lookup),
  `triforce` and `auto` write `ar`'s answer token for token. `apar` refuses this model in one line
  (it has no control tokens), and answers as `ar` does on an official APAR checkpoint's shape
  (Vicuna + [SplitMask], [SplitSop]: fixtures/torch_ckpt/apar_spm).
"""

import json

import pytest

from mlx_specdec.cli import main
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.decoding.apar import NoControlTokens
from mlx_specdec.engine import Engine
from mlx_specdec.errors import run_guarded
from mlx_specdec.model.loader import VICUNA_TEMPLATE, load_model, load_tokenizer_only

from vicuna_helpers import FIX, SPM_VOCAB, train_tokenizer_model, vicuna_dir

STRINGS = [
    "Hello world",
    "Why is the sky blue?",
    "  two  spaces, and a tab\there",
    " a leading space",
    "trailing spaces   ",
    "   ",
    "",
    "line one\nline two\n\n    indented\n",
    "café, naïve, déjà vu: 東京 and 日本語 🙂",
    "unseen: Ünïcödé ß ∑ ☃ 😀😀",  # none of these in the training text: byte fallback
    "digits 2024 and 3.14159",
    "crlf\r\nend",
]
SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
          "helpful, detailed, and polite answers to the user's questions.")
QUESTION = "Why is the sky blue? Light scatters in air."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_SPECDEC_HOME", str(tmp_path_factory.mktemp("home")))
        yield


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory):
    return train_tokenizer_model(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def sp(tokenizer_model):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(tokenizer_model))


@pytest.fixture(scope="module")
def vicuna(tmp_path_factory, home, tokenizer_model):
    """Vicuna v1.5's layout (its tokenizer_config.json and special_tokens_map.json), loaded."""
    path = vicuna_dir(tmp_path_factory.mktemp("repo") / "vicuna-tiny", tokenizer_model=tokenizer_model)
    lm = load_model(str(path))
    return lm, Engine(lm, drafter=None, apar_adapter=None), path


def answer(engine, method, prompt=QUESTION, **options):
    events = list(engine.generate(prompt, method, GenerationParams(max_tokens=MAX_TOKENS, options=options)))
    assert events[-1].kind == "done"
    return [t for e in events if e.kind == "token" for t in e.tokens], events[-1].stats


def test_the_trained_tokenizer_model_is_llamas_kind(sp):
    assert sp.get_piece_size() == SPM_VOCAB
    for fixture in ("vicuna_spm", "apar_spm"):
        config = json.loads((FIX / fixture / "config.json").read_text())
        assert config["vocab_size"] == SPM_VOCAB + (2 if fixture == "apar_spm" else 0)
    assert [sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert (sp.bos_id(), sp.eos_id(), sp.unk_id()) == (1, 2, 0)
    assert "<0xE2>" in sp.encode("☃", out_type=str)  # not in the training text: its UTF-8 bytes
    assert sp.encode("  x", out_type=str)[:2] == ["▁", "▁"]  # spaces as written, after the dummy prefix


@pytest.mark.parametrize("layout", ["tokenizer.model only", "with Vicuna's tokenizer_config.json"])
def test_the_tokenizer_encodes_as_sentencepiece_does(tmp_path, home, tokenizer_model, sp, layout):
    path = vicuna_dir(tmp_path / "vicuna-tiny", tokenizer_config=layout != "tokenizer.model only",
                      tokenizer_model=tokenizer_model)
    lm = load_tokenizer_only(str(path))
    assert not (lm.path / "tokenizer.json").exists() and (lm.path / "tokenizer.model").exists()
    tokenizer = lm.tokenizer
    for text in STRINGS:
        ids = sp.encode(text)
        assert tokenizer.encode(text) == [sp.bos_id()] + ids, text  # BOS, as Llama's tokenizer adds it
        assert tokenizer.decode(ids) == sp.decode(ids) == text, text
        assert tokenizer._tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text
    assert lm.tokenizer.eos_token_ids == {sp.eos_id()}


def test_without_a_chat_template_the_prompt_is_vicuna_s_conversation(vicuna, sp):
    lm = vicuna[0]
    assert lm.tokenizer.chat_template == VICUNA_TEMPLATE
    ids = lm.encode_prompt(QUESTION)
    assert ids == [sp.bos_id()] + sp.encode(f"{SYSTEM} USER: {QUESTION} ASSISTANT:")
    assert sp.decode(ids) == f"{SYSTEM} USER: {QUESTION} ASSISTANT:"
    turns = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."},
             {"role": "user", "content": QUESTION}]
    assert lm.encode_chat(turns) == ([sp.bos_id()] + sp.encode(f"{SYSTEM} USER: Hello ASSISTANT: Hi there.")
                                     + [sp.eos_id()] + sp.encode(f"USER: {QUESTION} ASSISTANT:"))
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert lm.encode_chat(system) == [sp.bos_id()] + sp.encode("Be brief. USER: Hi ASSISTANT:")
    assert lm.encode_prompt("Hi", chat=False) == [sp.bos_id()] + sp.encode("Hi")


@pytest.fixture(scope="module")
def ar_answer(vicuna):
    tokens, stats = answer(vicuna[1], "ar")
    assert len(tokens) == MAX_TOKENS and stats.method == "ar"  # EOS's head row is zero: never ends early
    return tokens


@pytest.mark.parametrize("method", ["mlx-lm", "redrafter", "triforce", "auto"])
def test_every_method_answers_as_ar_does(vicuna, ar_answer, method):
    tokens, stats = answer(vicuna[1], method)
    assert tokens == ar_answer, method
    if method == "redrafter":
        assert "head" not in stats.extra["source_steps"]  # no head: prompt lookup
    if method == "auto":
        assert stats.extra["auto"]["chose"] == stats.method == "ar"  # no head: plain decoding


def test_apar_refuses_vicuna_in_one_line(vicuna, capsys):
    assert run_guarded(lambda _: answer(vicuna[1], "apar"), None) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: apar needs a model with [Fork]/[Child] control tokens")
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(NoControlTokens):
        answer(vicuna[1], "apar")


def test_apar_answers_on_an_official_apar_checkpoint_s_shape(tmp_path, home, tokenizer_model, sp):
    from mlx_specdec.apar.tokens import control_tokens_for

    path = vicuna_dir(tmp_path / "apar-tiny", fixture="apar_spm", tokenizer_model=tokenizer_model)
    lm = load_model(str(path))
    assert (lm.path / "README.md").exists()  # the card, copied by the conversion: it says APAR
    control = control_tokens_for(lm)
    assert (control.fork, control.child, control.convention) == (SPM_VOCAB, SPM_VOCAB + 1, "apar")
    engine = Engine(lm, drafter=None, apar_adapter=None)
    want, _ = answer(engine, "ar")
    got, stats = answer(engine, "apar")
    assert got == want and len(got) == MAX_TOKENS  # [SplitMask]'s head row is zero: it never forks
    assert not stats.extra.get("forked", False)
    assert lm.encode_prompt(QUESTION) == [sp.bos_id()] + sp.encode(f"{SYSTEM} USER: {QUESTION} ASSISTANT:")


def test_the_cli_generates_from_the_bin_directory(vicuna, ar_answer, capsys):
    lm, _, source = vicuna  # the directory with the .bin shards (converted once, by the fixture)
    status = main(["generate", "-m", str(source), "-p", QUESTION, "--method", "triforce", "--max-tokens",
                   str(MAX_TOKENS), "--temp", "0", "--drafter", "none"])
    out, err = capsys.readouterr()
    assert status == 0 and "Traceback" not in err, err
    assert out.strip("\n") and "triforce" in err.splitlines()[-1]  # the answer, then the stats line
