"""Column-major float32 weights on the CPU (model/cpu_layout.py): same values, the same logits up to
the last bits (bit for bit where OpenBLAS runs the same kernel for both layouts, as on the VM the layout
was measured on; a CPU without AVX2 sums in another order) and the same greedy tokens."""

import mlx_specdec  # noqa: F401  (preloads BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama, save_tiny_model_dir

from mlx_specdec import masks
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.model.cpu_layout import LAID_OUT, is_column_major, store_column_major
from mlx_specdec.model.device import on_cpu
from mlx_specdec.model.forward import forward
from mlx_specdec.model.loader import load_model

PROMPT = mx.array([[5, 17, 3, 88, 41, 9, 60, 12]])


def laid_out(model):
    return [m for _, m in model.named_modules() if type(m) in LAID_OUT]


def row_major_again(model):
    for module in laid_out(model):
        module.weight = mx.contiguous(module.weight)
    mx.eval(model.parameters())


def assert_same_logits(got, expected):
    """Equal up to float rounding, and the same greedy token at every position."""
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)
        assert np.array_equal(a.argmax(-1), b.argmax(-1))


def prefill_and_verify(model):
    """Logits of a prefill, then of a 4-token tree verify with explicit positions and mask."""
    cache = ContiguousKVCache.for_model(model)
    prefill = forward(model, PROMPT, cache).logits
    parents = [-1, 0, 0, 1]  # a root, two children, a grandchild
    prefix = PROMPT.shape[1]
    positions = masks.tree_positions(parents, prefix)[None]  # (1, 4)
    mask = masks.prefix_tree_mask(parents, prefix)  # the tree over the whole cache
    verify = forward(model, mx.array([[7, 19, 2, 55]]), cache, positions=positions, mask=mask).logits
    mx.eval(prefill, verify)
    return np.array(prefill), np.array(verify)


@pytest.mark.parametrize("tie", [True, False])
def test_column_major_weights_keep_values_and_logits(tie):
    model = make_tiny_llama(tie=tie)
    before = [np.array(m.weight) for m in laid_out(model)]
    expected = prefill_and_verify(model)

    converted = store_column_major(model)

    assert converted == len(laid_out(model)) == 2 * 7 + 1 + (0 if tie else 1)  # 7 matrices a layer, embedding, lm_head
    for module, values in zip(laid_out(model), before):
        assert is_column_major(module.weight)
        assert module.weight.shape == values.shape
        assert np.array_equal(np.array(module.weight), values)
    got = prefill_and_verify(model)
    assert_same_logits(got, expected)
    assert store_column_major(model) == 0  # already laid out


def test_quantized_and_float16_layers_are_left_alone():
    quantized = make_tiny_llama()
    nn.quantize(quantized, group_size=32, bits=4)
    assert store_column_major(quantized) == 0
    half = make_tiny_llama(dtype=mx.float16)
    assert store_column_major(half) == 0
    assert not any(is_column_major(m.weight) for m in laid_out(half))


def test_a_weight_scaled_after_loading_computes_the_same_in_either_layout():
    model = make_tiny_llama()
    store_column_major(model)
    embed = model.model.embed_tokens
    embed.weight = embed.weight / 8  # what some tests do after loading (elementwise: the layout stays)
    got = prefill_and_verify(model)
    row_major_again(model)
    assert_same_logits(got[:1], prefill_and_verify(model)[:1])


@pytest.mark.skipif(not on_cpu(), reason="the layout is applied on the CPU only")
def test_load_model_lays_out_float32_weights_and_saves_them_row_major(tmp_path):
    lm = load_model(str(save_tiny_model_dir(tmp_path / "tiny")))
    assert lm.dtype == "float32"
    assert all(is_column_major(m.weight) for m in laid_out(lm.model))
    saved = tmp_path / "again.safetensors"
    mx.save_safetensors(str(saved), {"w": lm.model.model.layers[0].mlp.up_proj.weight})
    reloaded = mx.load(str(saved))["w"]
    assert np.array_equal(np.array(reloaded), np.array(lm.model.model.layers[0].mlp.up_proj.weight))


@pytest.mark.slow
@pytest.mark.skipif(not on_cpu(), reason="the layout is applied on the CPU only")
def test_default_model_logits_equal_its_row_major_copy():
    lm = load_model("default")
    assert is_column_major(lm.model.model.layers[0].self_attn.q_proj.weight)
    laid = prefill_and_verify(lm.model)
    row_major_again(lm.model)
    assert not is_column_major(lm.model.model.layers[0].self_attn.q_proj.weight)
    plain = prefill_and_verify(lm.model)
    assert_same_logits(laid, plain)
