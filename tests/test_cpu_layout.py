"""Row- or column-major float32 weights on the CPU (model/cpu_layout.py): same values, the same logits
up to the last bits (bit for bit where OpenBLAS runs the same kernel for both layouts) and the same
greedy tokens; the layout measured fastest on this machine is stored per model and machine and
applied at load (a small model is not probed; an environment variable overrides)."""

import mlx_specdec  # noqa: F401  (preloads BLAS before mlx)

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama, make_tiny_lm, save_tiny_model_dir

from mlx_specdec import masks
from mlx_specdec.cache import ContiguousKVCache
from mlx_specdec.model import cpu_layout
from mlx_specdec.model.cpu_layout import (COLUMN, LAID_OUT, ROW, current_layout, is_column_major,
                                          store_layout)
from mlx_specdec.model.device import on_cpu
from mlx_specdec.model.forward import forward
from mlx_specdec.model.loader import load_model

PROMPT = mx.array([[5, 17, 3, 88, 41, 9, 60, 12]])


def laid_out(model):
    return [m for _, m in model.named_modules() if type(m) in LAID_OUT]


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

    converted = store_layout(model, COLUMN)

    assert converted == len(laid_out(model)) == 2 * 7 + 1 + (0 if tie else 1)  # 7 matrices a layer, embedding, lm_head
    for module, values in zip(laid_out(model), before):
        assert is_column_major(module.weight)
        assert module.weight.shape == values.shape
        assert np.array_equal(np.array(module.weight), values)
    got = prefill_and_verify(model)
    assert_same_logits(got, expected)
    assert store_layout(model, COLUMN) == 0  # already laid out


def test_quantized_and_float16_layers_are_left_alone():
    quantized = make_tiny_llama()
    nn.quantize(quantized, group_size=32, bits=4)
    assert store_layout(quantized, COLUMN) == 0
    half = make_tiny_llama(dtype=mx.float16)
    assert store_layout(half, COLUMN) == 0
    assert not any(is_column_major(m.weight) for m in laid_out(half))


def test_a_weight_scaled_after_loading_computes_the_same_in_either_layout():
    model = make_tiny_llama()
    store_layout(model, COLUMN)
    embed = model.model.embed_tokens
    embed.weight = embed.weight / 8  # what some tests do after loading (elementwise: the layout stays)
    got = prefill_and_verify(model)
    store_layout(model, ROW)
    assert_same_logits(got[:1], prefill_and_verify(model)[:1])


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(cpu_layout.LAYOUT_ENV, raising=False)
    return tmp_path / "home"


def test_weights_go_back_to_row_major_with_the_same_values():
    model = make_tiny_llama()
    before = [np.array(m.weight) for m in laid_out(model)]
    assert current_layout(model) == ROW
    assert store_layout(model, COLUMN) == len(before) and current_layout(model) == COLUMN
    assert store_layout(model, ROW) == len(before) and current_layout(model) == ROW
    assert not any(is_column_major(m.weight) for m in laid_out(model))
    assert all(np.array_equal(np.array(m.weight), b) for m, b in zip(laid_out(model), before))
    with pytest.raises(ValueError):
        store_layout(model, "diagonal")


def test_column_major_is_chosen_only_when_clearly_faster():
    assert cpu_layout.faster_layout({ROW: 100.0, COLUMN: 90.0}) == COLUMN
    assert cpu_layout.faster_layout({ROW: 100.0, COLUMN: 98.0}) == ROW  # inside the margin: mlx-lm's own
    assert cpu_layout.faster_layout({ROW: 70.0, COLUMN: 100.0}) == ROW


def test_measuring_the_layouts_times_both_and_leaves_the_model_as_it_was():
    model = make_tiny_llama()
    store_layout(model, COLUMN)
    measured = cpu_layout.measure_layouts(model, rounds=1)
    assert set(measured) == {ROW, COLUMN} and all(ms > 0 for ms in measured.values())
    assert current_layout(model) == COLUMN


@pytest.mark.skipif(not on_cpu(), reason="the layout is applied on the CPU only")
def test_a_small_model_loads_as_mlx_lm_loads_it_without_a_probe(tmp_path, home):
    lm = load_model(str(save_tiny_model_dir(tmp_path / "tiny")))
    assert lm.dtype == "float32" and current_layout(lm.model) == ROW
    assert "not measured" in lm.layout and not (home / "cpu-layout").exists()


@pytest.mark.skipif(not on_cpu(), reason="the layout is applied on the CPU only")
def test_load_model_applies_the_layout_stored_for_this_machine_or_the_environment_s(tmp_path, home, monkeypatch):
    path = str(save_tiny_model_dir(tmp_path / "tiny"))
    name = load_model(path).name
    choice = cpu_layout.save_layout(name, "float32", {ROW: 10.0, COLUMN: 5.0}, rounds=3)
    assert choice.layout == COLUMN and str(cpu_layout.layout_path(name, "float32")) in choice.source
    lm = load_model(path)
    assert all(is_column_major(m.weight) for m in laid_out(lm.model)) and lm.layout.startswith("column-major")
    # still saved as plain row-major numbers
    saved = tmp_path / "again.safetensors"
    mx.save_safetensors(str(saved), {"w": lm.model.model.layers[0].mlp.up_proj.weight})
    reloaded = mx.load(str(saved))["w"]
    assert np.array_equal(np.array(reloaded), np.array(lm.model.model.layers[0].mlp.up_proj.weight))

    monkeypatch.setenv(cpu_layout.LAYOUT_ENV, "row")  # the override wins over the stored choice
    assert current_layout(load_model(path).model) == ROW
    monkeypatch.delenv(cpu_layout.LAYOUT_ENV)

    stored = cpu_layout.layout_path(name, "float32")
    record = json.loads(stored.read_text())
    record["machine"]["cores"] = -1  # measured on another machine
    stored.write_text(json.dumps(record))
    assert cpu_layout.stored_layout(name, "float32") is None
    assert current_layout(load_model(path).model) == ROW
    stored.write_text("{not json")
    assert cpu_layout.stored_layout(name, "float32") is None


def test_a_real_sized_model_is_probed_once_then_the_stored_choice_is_read(home, monkeypatch):
    model = make_tiny_llama()
    monkeypatch.setattr(cpu_layout, "PROBE_MIN_PARAMS", 0)  # the tiny model stands in for a real one
    probes = []
    monkeypatch.setattr(cpu_layout, "measure_layouts", lambda m, rounds: probes.append(rounds) or {ROW: 9.0, COLUMN: 6.0})
    first = cpu_layout.apply_cpu_layout(model, "tiny", "float32")
    assert probes == [cpu_layout.LOAD_ROUNDS] and first.layout == COLUMN and current_layout(model) == COLUMN
    again = cpu_layout.choose_layout(make_tiny_llama(), "tiny", "float32")
    assert probes == [cpu_layout.LOAD_ROUNDS] and again == first  # read back, not measured again


def test_the_draft_head_follows_the_llm_s_layout(tmp_path):
    from mlx_specdec.redrafter_head.model import DrafterConfig, DrafterHead, load_drafter, save_drafter, tokenizer_hash

    lm = make_tiny_lm()
    config = DrafterConfig(llm_hidden_size=64, embed_size=64, vocab_size=97, draft_vocab_size=40,
                           model_name="tiny", tokenizer_hash=tokenizer_hash(lm.tokenizer))
    save_drafter(DrafterHead(config, draft_to_full=list(range(40))), tmp_path, dtype=mx.float32)
    assert current_layout(load_drafter(tmp_path, lm)) == ROW
    store_layout(lm.model, COLUMN)
    assert current_layout(load_drafter(tmp_path, lm)) == (COLUMN if on_cpu() else ROW)


@pytest.mark.slow
@pytest.mark.skipif(not on_cpu(), reason="the layout is applied on the CPU only")
def test_default_model_logits_are_the_same_in_both_layouts():
    lm = load_model("default")
    store_layout(lm.model, COLUMN)
    assert is_column_major(lm.model.model.layers[0].self_attn.q_proj.weight)
    laid = prefill_and_verify(lm.model)
    store_layout(lm.model, ROW)
    assert not is_column_major(lm.model.model.layers[0].self_attn.q_proj.weight)
    plain = prefill_and_verify(lm.model)
    assert_same_logits(laid, plain)
