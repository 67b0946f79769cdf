"""A quantized model dequantized once at load (the CPU's fast path): the same weight values, so
the same logits up to rounding and the same greedy text; what `auto` decides; the flag's errors."""

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_specdec.errors import UnsupportedModel
from mlx_specdec.model import loader
from mlx_specdec.model.loader import float32_bytes, should_dequantize

from conftest import make_tiny_llama


def quantized_tiny():
    model = make_tiny_llama(seed=1)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_dequantized_weights_give_the_quantized_models_logits_and_the_predicted_size():
    from mlx_lm.utils import dequantize_model

    model = quantized_tiny()
    tokens = mx.array([[3, 14, 15, 9, 26, 5, 35]])
    want = model(tokens)
    predicted = float32_bytes(model)
    plain = dequantize_model(model)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in plain.named_modules())
    assert predicted == sum(v.nbytes for _, v in tree_flatten(plain.parameters()))
    got = plain(tokens)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    assert (mx.argmax(got, -1) == mx.argmax(want, -1)).all().item()


def test_auto_dequantizes_a_small_quantized_model_on_the_cpu_and_never_an_unquantized_one():
    model = quantized_tiny()
    assert should_dequantize(model, 4, "auto") is (mx.default_device() == mx.cpu)
    assert should_dequantize(model, 4, "on") and not should_dequantize(model, 4, "off")
    assert not should_dequantize(make_tiny_llama(), None, "on")
    with pytest.raises(UnsupportedModel, match="--dequantize is auto, on or off"):
        should_dequantize(model, 4, "maybe")


def test_a_cuda_gpu_counts_as_a_gpu_not_as_the_cpu(request, monkeypatch):
    """Linux with MLX's CUDA backend has no Metal: it must still get the checkpoint's dtype and its
    quantized weights as they are (a CPU-only rule there cost a 6-bit model's speed on an H200)."""
    model = nn.Embedding(8, 64)
    model = nn.QuantizedEmbedding.from_embedding(model, group_size=64, bits=4)
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)  # MLX computing on the CPU, on any machine
    assert loader.on_cpu() and loader.default_dtype({"torch_dtype": "float16"}) == "float32"

    request.getfixturevalue("fake_cuda_gpu")
    assert not loader.on_cpu()
    assert loader.default_dtype({"torch_dtype": "float16"}) == "float16"
    assert not should_dequantize(model, 4, "auto") and should_dequantize(model, 4, "on")


@pytest.mark.slow
def test_the_4bit_default_model_writes_the_same_text_dequantized():
    cli = [sys.executable, "-m", "mlx_specdec.cli", "generate", "-m", "default-4bit", "--max-tokens", "24", "--temp", "0",
           "-p", "Name three colours of the rainbow."]
    fast = subprocess.run(cli + ["--dequantize", "on"], capture_output=True, text=True, timeout=300)
    slow = subprocess.run(cli + ["--dequantize", "off"], capture_output=True, text=True, timeout=300)
    assert fast.returncode == 0 and slow.returncode == 0, fast.stderr + slow.stderr
    assert fast.stdout == slow.stdout and len(fast.stdout.split()) >= 5
