import mlx_specdec  # noqa: F401  (preloads BLAS before mlx)

import os
import tempfile

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from mlx_specdec.jsonstore import MEASURED_DIR_ENV

# What `auto` and the plain rate measure goes to a directory of the test run's own (inherited by
# the CLI and server subprocesses), never into the user's cache beside the models.
os.environ[MEASURED_DIR_ENV] = tempfile.mkdtemp(prefix="mlx-specdec-measured-")


def make_tiny_llama(seed: int = 0, layers: int = 2, tie: bool = True, dtype=mx.float32, **overrides):
    """A random-init Llama with GQA, small enough for exact tests without any download."""
    args = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=97,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
    )
    args.update(overrides)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(**args))
    # Random init gives near-uniform logits; scale the embeddings so argmax is well separated.
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 8
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@pytest.fixture
def tiny_model():
    return make_tiny_llama()


def make_tiny_tokenizer(vocab_size: int = 97, eos_id: int = 2):
    """A real (word-level) Hugging Face fast tokenizer wrapped by mlx-lm: token i <-> "w{i} "."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{eos_id}", unk_token="w0")
    return TokenizerWrapper(fast)


def make_tiny_lm(seed: int = 0, layers: int = 2, eos_id: int = 2, context: int = 512, **overrides):
    """A `LoadedModel` around a tiny random Llama and the word-level tokenizer above."""
    from pathlib import Path
    from mlx_specdec.model.loader import LoadedModel

    model = make_tiny_llama(seed=seed, layers=layers, tie=False, **overrides)
    config = {"model_type": "llama", "max_position_embeddings": context, "vocab_size": 97}
    return LoadedModel(model, make_tiny_tokenizer(eos_id=eos_id), Path("."), "tiny-llama",
                       config, "float32", None)


@pytest.fixture
def tiny_lm():
    return make_tiny_lm()


def save_tiny_model_dir(path, context: int = 512, seed: int = 0):
    """Write a tiny Llama in Hugging Face / mlx-lm layout (config, safetensors, tokenizer)."""
    import json
    from mlx.utils import tree_flatten

    lm = make_tiny_lm(seed=seed, context=context)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(lm.model.args.__dict__)
    config.update(model_type="llama", max_position_embeddings=context, architectures=["LlamaForCausalLM"])
    config = {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool, list, type(None)))}
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    lm.tokenizer._tokenizer.save_pretrained(str(path))
    return path


def tree_path(parents, i):
    """Indices on token i's path from its root, root first (parents[i] = -1 for a root)."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.fixture
def fake_cuda_gpu(monkeypatch):
    """MLX as it looks on Linux with the CUDA backend (no Metal, the default device a GPU), for the
    rules that choose by backend; the arrays still live where they do here."""
    from mlx_specdec.model import device

    class FakeCuda:
        @staticmethod
        def is_available():
            return True

    monkeypatch.setattr(device.mx, "cuda", FakeCuda)
    monkeypatch.setattr(device.mx, "default_device", lambda: mx.gpu)
