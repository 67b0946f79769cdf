import mlx_specdec  # noqa: F401  (preloads BLAS before mlx)

import mlx.core as mx
import pytest
from mlx_lm.models import llama


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
