"""No hidden assumptions about the default model: tiny random Llama-family checkpoints of other
shapes, written to disk as Hugging Face directories and loaded through `load_model`, decode every
lossless method's greedy answer equal to `ar`'s, token for token.

The shapes: MHA, GQA 2 and 4, MQA (one KV head); tied and untied embeddings; a vocabulary that is
no multiple of 64; plain RoPE at two thetas and Llama 3's scaled RoPE; a bfloat16 checkpoint
(computed in float32, the CPU's default, and in bfloat16); an explicit head_dim with q/k/v biases;
a Mistral config, and one with mlx-lm's sliding-window layers (its context capped at the window);
Qwen2 (q/k/v biases, tied, RoPE base 1e6) and Qwen3 (per-head q/k norms, a head_dim that is not
hidden / heads), built by mlx-lm's own qwen2 / qwen3 classes.
The methods: `mlx-lm` (its own loop over its own model: `ar` == `mlx-lm` checks
this engine's forward itself), `auto` (ar or redrafter, as it chooses), `redrafter` without a head
(prompt lookup), with a random head,
with a 1-layer draft model of the same shape, `triforce` with its n-gram bottom over a small
retrieval cache, and `apar` (each tokenizer has [Fork]/[Child]; their head rows, and EOS's, are
zero so that no method ever picks them and every answer runs to max_tokens). In bfloat16, mlx-lm's
answer may part from `ar`'s only at a tie of its own rounding (`check_a_log_softmax_tie`).
The pipeline methods run as separate `mx.distributed` ranks (tests/test_pipeline.py), not in
process: they are not in this matrix.
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import make_prompt_cache

from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.decoding.apar import NoControlTokens
from mlx_specdec.engine import Engine
from mlx_specdec.errors import ContextOverflow
from mlx_specdec.model.forward import forward
from mlx_specdec.model.loader import load_model
from mlx_specdec.redrafter_head.model import DrafterConfig, DrafterHead

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, rope_theta=10000.0, tie_word_embeddings=False)

# name -> (config overrides, load dtype)
SHAPES = {
    "mha-tied": (dict(num_key_value_heads=4, tie_word_embeddings=True), "auto"),
    "gqa2-untied": (dict(rope_theta=500000.0), "auto"),
    "gqa4-vocab251": (dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=251), "auto"),
    "mqa-tied": (dict(num_key_value_heads=1, tie_word_embeddings=True, hidden_size=48), "auto"),
    "llama3-rope": (dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)), "auto"),
    "bf16-checkpoint": (dict(torch_dtype="bfloat16"), "auto"),
    "bf16-compute": (dict(torch_dtype="bfloat16", num_key_value_heads=1), "bfloat16"),
    "head-dim-bias": (dict(head_dim=24, attention_bias=True, num_key_value_heads=2), "auto"),
    "mistral": (dict(model_type="mistral", architectures=["MistralForCausalLM"], num_attention_heads=8,
                     num_key_value_heads=2, sliding_window=4096), "auto"),
    # Sliding-window layers (mlx-lm's `layer_types`): the context is capped at the window, where
    # attending every key is the same attention; prompt + answer fill it exactly.
    "sliding-layers": (dict(model_type="mistral", layer_types=["full_attention", "sliding_attention"],
                            sliding_window=64), "auto"),
    "qwen2": (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                   rope_theta=1000000.0), "auto"),
    "qwen3": (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True,
                   rope_theta=1000000.0, head_dim=24, num_attention_heads=4, num_key_value_heads=2), "auto"),
}
MODEL_CLASSES = {"llama": llama, "mistral": llama, "qwen2": qwen2, "qwen3": qwen3}  # as mlx-lm maps them

METHODS = ["mlx-lm", "auto", "redrafter-lookup", "redrafter-head", "redrafter-draft-model", "triforce-ngram", "apar"]

MAX_TOKENS = 32
# Repeats itself, so prompt lookup has continuations to offer from the first step.
PROMPT_BODY = [5, 17, 42, 3, 8, 11, 5, 17, 42, 3, 8, 11, 23, 5, 17, 42, 60, 9, 9, 33, 5, 17, 42, 3, 8, 11, 71,
               12, 5, 17, 42, 3]


def word_tokenizer(vocab_size: int, eos_id: int, control: bool = True):
    """Word-level fast tokenizer: id i <-> "w{i}"; with `control` the last two ids are [Fork], [Child]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    if control:
        vocab.update({"[Fork]": vocab_size - 2, "[Child]": vocab_size - 1})
        del vocab[f"w{vocab_size - 2}"], vocab[f"w{vocab_size - 1}"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{eos_id}", unk_token="w0")


def write_checkpoint(path, overrides: dict, seed: int, layers: int = 2, control: bool = True):
    """A random Llama of this shape as config.json + model.safetensors + tokenizer files."""
    config = dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                  max_position_embeddings=512, torch_dtype="float32")
    config.update(overrides, num_hidden_layers=layers)
    if "layer_types" in config:  # one per layer (a 1-layer draft model keeps the first: mlx-lm needs a full-attention one)
        config["layer_types"] = config["layer_types"][:layers]
    vocab = config["vocab_size"]
    eos = vocab - 3
    config.update(bos_token_id=1, eos_token_id=eos)
    module = MODEL_CLASSES[config["model_type"]]
    known = module.ModelArgs.__dataclass_fields__
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**{k: v for k, v in config.items() if k in known}))
    # Random init gives near-uniform logits: scaled embeddings separate the argmax. The head rows of
    # EOS, [Fork] and [Child] are zero (logit 0 below the best of ~100 random ones): never picked.
    embed = np.array(model.model.embed_tokens.weight) * 8
    head = embed if config["tie_word_embeddings"] else np.array(model.lm_head.weight)
    head[[eos, vocab - 2, vocab - 1]] = 0.0
    model.model.embed_tokens.weight = mx.array(embed)
    if not config["tie_word_embeddings"]:
        model.lm_head.weight = mx.array(head)
    weights = dict(tree_flatten(model.parameters()))
    dtype = getattr(mx, config["torch_dtype"])
    weights = {k: v.astype(dtype) for k, v in weights.items()}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    word_tokenizer(vocab, eos, control).save_pretrained(str(path))
    return path


class Loaded:
    """One shape on disk, loaded; its engines and its `ar` answer, made once for all methods."""

    def __init__(self, root, name):
        overrides, dtype = SHAPES[name]
        seed = sorted(SHAPES).index(name)
        self.name, self.overrides = name, overrides
        self.path = write_checkpoint(root / name, overrides, seed)
        self.lm = load_model(str(self.path), dtype=dtype)
        self.vocab = self.lm.model.model.embed_tokens.weight.shape[0]
        self.prompt = [t % (self.vocab - 3) for t in PROMPT_BODY]
        self.engine = Engine(self.lm, drafter=None, apar_adapter=None)
        self.want = self.run(self.engine, "ar")

    def run(self, engine, method, **options):
        events = list(engine.generate_ids(self.prompt, method, GenerationParams(max_tokens=MAX_TOKENS,
                                                                                options=options)))
        tokens = [t for e in events if e.kind == "token" for t in e.tokens]
        return tokens, events[-1].stats

    def draft_engine(self):
        draft = load_model(str(write_checkpoint(self.path.parent / f"{self.name}-draft", self.overrides,
                                                seed=100, layers=1)), dtype=self.lm.dtype)
        return Engine(self.lm, drafter=None, apar_adapter=None, draft_model=draft)

    def head_engine(self):
        hidden = self.lm.model.args.hidden_size
        mx.random.seed(7)
        draft_vocab = min(50, self.vocab)
        config = DrafterConfig(llm_hidden_size=hidden, embed_size=hidden, vocab_size=self.vocab,
                               draft_vocab_size=draft_vocab)
        head = DrafterHead(config, mx.array(np.random.default_rng(7).permutation(self.vocab)[:draft_vocab]))
        head.set_dtype(getattr(mx, self.lm.dtype))
        mx.eval(head.parameters())
        engine = Engine(self.lm, drafter=None, apar_adapter=None)
        engine._resources["drafter"] = head
        return engine


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    made = {}

    def get(name):
        if name not in made:
            made[name] = Loaded(root, name)
        return made[name]

    return get


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_method_writes_ar_s_greedy_answer(shapes, shape, method):
    s = shapes(shape)
    want, _ = s.want
    assert len(want) == MAX_TOKENS
    if method == "mlx-lm":
        got, stats = s.run(s.engine, "mlx-lm")
        if s.lm.dtype != "float32" and got != want:
            check_a_log_softmax_tie(s, want, got)
            return
    elif method == "auto":
        got, stats = s.run(s.engine, "auto")
        assert stats.extra["auto"]["chose"] == stats.method in ("ar", "redrafter")
    elif method == "redrafter-lookup":
        got, stats = s.run(s.engine, "redrafter")
        assert "head" not in stats.extra["source_steps"]
        assert stats.extra["lookup_accepted_per_step"] > 0  # verification saw accepted drafts
    elif method == "redrafter-head":
        got, stats = s.run(s.head_engine(), "redrafter", beam_width=2, beam_length=4, draft_cutoff=0.0)
        assert stats.extra["source_steps"].get("head", 0) > 0
    elif method == "redrafter-draft-model":
        got, stats = s.run(s.draft_engine(), "redrafter")
    elif method == "triforce-ngram":
        got, stats = s.run(s.engine, "triforce", bottom="ngram", budget=16, gamma=4)
        assert stats.forward_passes < len(got)  # full-cache verifies accepted several tokens
    else:
        got, stats = s.run(s.engine, "apar")
        assert not stats.extra.get("forked", False)
    assert got == want


def check_a_log_softmax_tie(s, want, got):
    """mlx-lm's greedy sampler takes the argmax of log-softmax in the model's dtype: in bfloat16 two
    logits one unit in the last place apart (0.973 and 0.969) can round to the same log-probability
    (-3.78, whose unit is 0.016), and the tie goes to the lower id; `ar` takes the argmax of the
    logits. So the answers may part there, and only there: at the first difference, mlx-lm's token
    ties `ar`'s in bfloat16 log-probabilities and `ar`'s has the larger logit."""
    i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    logits = s.lm.model(mx.array([s.prompt + want[:i]]))[0, -1]
    logprobs = np.array((logits - mx.logsumexp(logits, keepdims=True)).astype(mx.float32))
    logits = np.array(logits.astype(mx.float32))
    assert logprobs[want[i]] == logprobs[got[i]] == logprobs.max() and got[i] < want[i]
    assert logits[want[i]] == logits.max() > logits[got[i]]


def test_shapes_are_what_they_say(shapes):
    """The loader built each shape as configured (so the matrix above tests what it names)."""
    for name, (overrides, dtype) in SHAPES.items():
        lm = shapes(name).lm
        attn = lm.model.model.layers[0].self_attn
        heads = overrides.get("num_attention_heads", BASE["num_attention_heads"])
        assert (attn.n_heads, attn.n_kv_heads) == (heads, overrides.get("num_key_value_heads",
                                                                         BASE["num_key_value_heads"])), name
        tied = overrides.get("tie_word_embeddings", BASE["tie_word_embeddings"])
        assert hasattr(lm.model, "lm_head") != tied, name
        assert lm.dtype == ("bfloat16" if dtype == "bfloat16" else "float32"), name
        assert lm.model.model.embed_tokens.weight.dtype == getattr(mx, lm.dtype), name
        rope = type(attn.rope).__name__
        assert rope == ("Llama3RoPE" if "rope_scaling" in overrides else "RoPE"), name
        model_type = overrides.get("model_type", "llama")
        assert lm.model.model_type == model_type and type(lm.model) is MODEL_CLASSES[model_type].Model, name
        assert hasattr(attn, "q_norm") == (model_type == "qwen3"), name
        if model_type == "qwen2":
            assert all("bias" in getattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")), name
        if "head_dim" in overrides:
            assert attn.q_proj.weight.shape[0] == heads * overrides["head_dim"], name
            assert model_type == "qwen3" or "bias" in attn.q_proj, name
    stored = mx.load(str(shapes("bf16-checkpoint").path / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in stored.values())


def test_llama3_rope_scaling_changes_the_answer(shapes):
    """The scaled RoPE is really applied: the same weights with plain RoPE decode differently."""
    s = shapes("llama3-rope")
    plain = load_model(str(s.path))
    for layer in plain.model.model.layers:
        layer.self_attn.rope = nn.RoPE(layer.self_attn.rope.dims, traditional=False, base=500000.0)
    logits = lambda lm: np.array(lm.model(mx.array([s.prompt]))[0])  # noqa: E731
    assert not np.allclose(logits(plain), logits(s.lm), atol=1e-4)


def test_sliding_window_layers_cap_the_context_where_full_attention_is_the_same(shapes):
    """The engine's forward attends every cached key; over a sequence that fills the window it
    equals mlx-lm's model with its sliding-window layers, and a longer prompt is refused."""
    s = shapes("sliding-layers")
    assert s.lm.context_length == 64
    assert [layer.use_sliding for layer in s.lm.model.model.layers] == [False, True]
    model = s.lm.model
    scaled = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = scaled / 8  # init scale: the logits depend on the whole context
    try:
        tokens = mx.array([(s.prompt + s.want[0])[:64]])
        theirs = model(tokens, cache=make_prompt_cache(model))[0]
        ours = forward(model, tokens, ContiguousKVCache.for_model(model)).logits[0]
        assert np.allclose(np.array(theirs), np.array(ours), atol=1e-5)
    finally:
        model.model.embed_tokens.weight = scaled
    with pytest.raises(ContextOverflow, match="context window of .* is 64"):
        list(s.engine.generate_ids(list(range(3, 67)), "ar", GenerationParams(max_tokens=4)))


@pytest.mark.parametrize("shape", ["llama", "qwen2", "qwen3"])
def test_apar_refuses_a_model_without_control_tokens_in_one_line(tmp_path, shape):
    overrides = dict(num_key_value_heads=1) if shape == "llama" else dict(SHAPES[shape][0])
    path = write_checkpoint(tmp_path / "plain", overrides, seed=0, control=False)
    engine = Engine(load_model(str(path)), drafter=None, apar_adapter=None)
    with pytest.raises(NoControlTokens, match=r"apar needs a model with \[Fork\]/\[Child\] control tokens"):
        list(engine.generate_ids([5, 6, 7], "apar", GenerationParams(max_tokens=4)))
