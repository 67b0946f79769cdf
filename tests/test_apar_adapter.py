"""APAR adapter on a tiny random Llama: trainable parts, save/load, fused decoding model, engine."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_specdec.apar import control_tokens_for
from mlx_specdec.apar.adapter import (find_shipped_adapter, load_apar_model, prepare_for_training, save_adapter,
                                      trainable_weights)
from mlx_specdec.apar.config import AdapterMismatch, LoraSettings
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine
from mlx_specdec.model.forward import forward
from mlx_specdec.model.loader import LoadedModel

from conftest import make_tiny_llama, make_tiny_tokenizer

V = 97


def tiny_lm(tie: bool, seed: int = 0) -> LoadedModel:
    model = make_tiny_llama(seed=seed, layers=2, tie=tie)
    config = {"model_type": "llama", "max_position_embeddings": 512, "vocab_size": V}
    return LoadedModel(model, make_tiny_tokenizer(), Path("."), "tiny-llama", config, "float32", None)


def logits(model, tokens):
    return np.array(forward(model, mx.array(tokens)[None]).logits[0])


TOKENS = [5, 17, 42, 3, 88]


@pytest.mark.parametrize("tie", [True, False])
def test_training_model_trains_only_lora_and_the_new_rows(tie):
    lm = tiny_lm(tie)
    before = logits(lm.model, TOKENS)
    adapted, config = prepare_for_training(lm, LoraSettings(rank=4, scale=10.0))
    names = set(trainable_weights(adapted.model))
    assert names and all(n.endswith((".lora_a", ".lora_b", ".extra")) for n in names)
    assert "model.embed_tokens.extra" in names
    assert ("lm_head.extra" in names) == (not tie)
    # LoRA starts at zero (lora_b = 0): base tokens score exactly as before, plus two new logits
    after = logits(adapted.model, TOKENS)
    assert after.shape == (len(TOKENS), V + 2)
    np.testing.assert_allclose(after[:, :V], before, atol=1e-5)
    control = control_tokens_for(adapted)
    assert (control.fork, control.child, control.convention) == (V, V + 1, "project")
    assert adapted.tokenizer.encode("[Fork] w5 [Child]") == [V, 5, V + 1]
    assert config.tied == tie and config.base_vocab_size == V


@pytest.mark.parametrize("tie", [True, False])
def test_saved_adapter_loads_as_a_fused_model_sharing_the_base_arrays(tmp_path, tie):
    trained_lm = tiny_lm(tie)
    adapted, config = prepare_for_training(trained_lm, LoraSettings(rank=4, scale=10.0))
    # pretend training moved every trainable array
    rng = np.random.default_rng(0)
    moved = [(k, mx.array(rng.normal(0, 0.05, v.shape).astype(np.float16)).astype(mx.float32))
             for k, v in trainable_weights(adapted.model).items()]  # float16-exact: saved losslessly
    adapted.model.update(tree_unflatten(moved))
    save_adapter(adapted.model, config, tmp_path)
    assert (tmp_path / "adapter_config.json").exists()
    # float16 on disk: LoRA + 2 rows only
    size = (tmp_path / "adapters.safetensors").stat().st_size
    assert size < 0.2 * sum(v.nbytes for _, v in tree_flatten(adapted.model.parameters()))
    ids = TOKENS + [V, 7, V + 1, 9]
    want = logits(adapted.model, ids)

    base = tiny_lm(tie)  # a fresh load of the same base model
    base_before = logits(base.model, TOKENS)
    apar = load_apar_model(tmp_path, base)
    got = logits(apar.model, ids)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)  # fused vs LoRA: rounding only
    np.testing.assert_allclose(logits(base.model, TOKENS), base_before, atol=0)  # base untouched
    assert base.tokenizer.encode("w5") == [5] and control_tokens_for(base) is None
    # unwrapped arrays are the very same objects (no copy); wrapped linears got fused weights
    b0, a0 = base.model.model.layers[0], apar.model.model.layers[0]
    assert a0.input_layernorm.weight is b0.input_layernorm.weight
    assert a0.self_attn.q_proj.weight is not b0.self_attn.q_proj.weight
    assert type(a0.self_attn.q_proj).__name__ == "Linear"  # fused, no LoRA matmuls at decode time
    assert apar.model.model.embed_tokens.base.weight is base.model.model.embed_tokens.weight


def test_adapter_for_another_model_is_refused_and_not_auto_found(tmp_path):
    adapted, config = prepare_for_training(tiny_lm(True), LoraSettings(rank=2))
    save_adapter(adapted.model, config, tmp_path / "apar-tiny")
    other = tiny_lm(True)
    other.tokenizer = make_tiny_tokenizer(vocab_size=V)  # same vocabulary: compatible
    assert find_shipped_adapter(other, tmp_path) == tmp_path / "apar-tiny"
    config_path = tmp_path / "apar-tiny" / "adapter_config.json"
    config_path.write_text(config_path.read_text().replace(config.tokenizer_hash, "0" * 64))
    with pytest.raises(AdapterMismatch, match="trained for"):
        load_apar_model(tmp_path / "apar-tiny", other)
    assert find_shipped_adapter(other, tmp_path) is None


def test_engine_decodes_apar_with_the_adapter_and_ar_with_the_original(tmp_path):
    adapted, config = prepare_for_training(tiny_lm(False), LoraSettings(rank=2))
    save_adapter(adapted.model, config, tmp_path)
    engine = Engine(tiny_lm(False), apar_adapter=str(tmp_path))
    assert engine.lm_for("ar") is engine.lm
    assert engine.lm_for("apar") is engine.apar_lm and engine.apar_lm is not engine.lm
    ar = [t for e in engine.generate_ids(TOKENS, "ar", GenerationParams(max_tokens=12))
          if e.kind == "token" for t in e.tokens]
    # an untrained adapter (LoRA B = 0) with forking off decodes exactly like the base model
    events = list(engine.generate_ids(TOKENS, "apar", GenerationParams(max_tokens=12, options={"max_depth": 0})))
    assert events[-1].kind == "done" and events[-1].stats.method == "apar"
    apar = [t for e in events if e.kind == "token" for t in e.tokens]
    assert apar == ar
    assert Engine(tiny_lm(False), apar_adapter=None).apar_lm is None
