"""`import-drafter`: a checkpoint written as Apple's `recurrent_drafting` writes one (its config keys
and tensor names, random weights) imported for a tiny Llama; the imported head's draft logits and
beam drafts checked against Apple's drafter written out here in numpy from its equations; the
command's one-line errors; and `redrafter` with the head writing `ar`'s answer."""

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_specdec.cli import main
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine
from mlx_specdec.model.loader import load_model
from mlx_specdec.redrafter_head.beam import beam_search
from mlx_specdec.redrafter_head.model import load_drafter

from conftest import save_tiny_model_dir

H, V = 64, 97  # the tiny Llama's hidden size and vocabulary


def write_apple_checkpoint(path, hidden=H, vocab=V, exit_dim=2 * H, layers=2, rnn=True, seed=0,
                           model_type="recurrent_drafting_drafter"):
    """config.json as transformers' PretrainedConfig writes Apple's DrafterConfig, and
    model.safetensors with the tensor names of Apple's `Drafter` module."""
    rng = np.random.default_rng(seed)

    def rand(*shape, scale):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    weights = {}
    if exit_dim != 2 * hidden:
        weights["input_proj.weight"] = rand(exit_dim, 2 * hidden, scale=(2 * hidden) ** -0.5)
        weights["input_proj.bias"] = rand(exit_dim, scale=0.1)
    for i in range(layers):
        weights[f"lm_head.{i}.linear.weight"] = rand(exit_dim, exit_dim, scale=exit_dim ** -0.5)
        weights[f"lm_head.{i}.linear.bias"] = rand(exit_dim, scale=0.1)
    weights[f"lm_head.{layers}.weight"] = rand(vocab, exit_dim, scale=2 * exit_dim ** -0.5)
    if rnn:
        weights["rnn_u.weight"] = rand(hidden, hidden, scale=hidden ** -0.5)
        weights["rnn_u.bias"] = rand(hidden, scale=0.1)
        weights["rnn_w.weight"] = rand(hidden, hidden, scale=hidden ** -0.5 / 8)  # embeddings are ~8x
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Drafter"], "exit_dim": exit_dim, "hidden_size": hidden,
              "model_type": model_type, "num_draft_layers": layers, "num_lookback_tokens": 1,
              "rnn": rnn, "torch_dtype": "float32", "transformers_version": "4.41.2", "vocab_size": vocab}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return config, weights


# Apple's drafter, from its equations (recurrent_drafting/modeling_drafter.py), in numpy.
def silu(x):
    return x / (1.0 + np.exp(-x))


def apple_state(w, cfg, state, emb):
    if cfg["rnn"]:
        return silu(emb @ w["rnn_w.weight"].T + state @ w["rnn_u.weight"].T + w["rnn_u.bias"])
    return state + emb


def apple_logits(w, cfg, hidden, state):
    x = np.concatenate([hidden, state], axis=-1)  # context first, then the RNN state
    if "input_proj.weight" in w:
        x = x @ w["input_proj.weight"].T + w["input_proj.bias"]
    n = cfg["num_draft_layers"]
    for i in range(n):
        x = x + silu(x @ w[f"lm_head.{i}.linear.weight"].T + w[f"lm_head.{i}.linear.bias"])
    return x @ w[f"lm_head.{n}.weight"].T


def apple_log_probs(logits, top_k=50):
    x = logits - logits.max(axis=-1, keepdims=True)
    kth = np.sort(x, axis=-1)[..., -top_k][..., None]
    x = np.where(x < kth, -50000.0, x)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def apple_beam_search(w, cfg, hidden, first, table, width, length):
    scores = np.array([0.0] + [-50000.0] * (width - 1))
    beams = np.full((width, 1), first)
    state = np.zeros((width, cfg["hidden_size"]), dtype=np.float32)
    chosen = np.zeros((width, 0))
    for _ in range(length - 1):
        state = apple_state(w, cfg, state, table[beams[:, -1]])
        logp = apple_log_probs(apple_logits(w, cfg, np.broadcast_to(hidden, state.shape), state))
        total = (logp + scores[:, None]).reshape(-1)
        top = np.argsort(-total, kind="stable")[:width]
        parent, token = top // logp.shape[-1], top % logp.shape[-1]
        scores = total[top]
        beams = np.concatenate([beams[parent], token[:, None]], axis=1)
        chosen = np.concatenate([chosen[parent], logp[parent, token][:, None]], axis=1)
        state = state[parent]
    return beams, chosen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def lm(model_dir):
    return load_model(str(model_dir))


def import_head(tmp_path, model_dir, **kwargs):
    cfg, weights = write_apple_checkpoint(tmp_path / "apple", **kwargs)
    out = tmp_path / "head"
    assert main(["import-drafter", str(tmp_path / "apple"), "--model", str(model_dir), "-o", str(out)]) == 0
    return cfg, weights, out


VARIANTS = {"rnn": dict(rnn=True), "rnn+input_proj": dict(rnn=True, exit_dim=96, layers=3),
            "sum": dict(rnn=False, layers=1)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_imported_head_computes_apple_s_drafter(tmp_path, model_dir, lm, variant):
    cfg, w, out = import_head(tmp_path, model_dir, **VARIANTS[variant])
    head = load_drafter(out, lm)
    assert (out / "CARD.md").exists()
    table = np.array(lm.model.model.embed_tokens.weight.astype(mx.float32))
    hidden = np.random.default_rng(1).normal(size=(H,)).astype(np.float32)
    tokens = [5, 17, 42, 3, 60]
    # Teacher-forced steps: the draft logits after each token, raw and after Apple's top-50 warp.
    ref_state = np.zeros((H,), dtype=np.float32)
    state = None
    for t in tokens:
        ref_state = apple_state(w, cfg, ref_state, table[t])
        e = mx.array(table[t][None])
        state = head.initial_state(e) if state is None else head.next_state(state, e)
        want = apple_logits(w, cfg, hidden, ref_state)
        np.testing.assert_allclose(np.array(state[0]), ref_state, atol=1e-4, rtol=1e-4)
        got = head.logits(state, mx.array(hidden[None]))
        np.testing.assert_allclose(np.maximum(np.array(nn_log_softmax(got))[0], -1000.0),
                                   np.maximum(apple_log_probs(want), -1000.0), atol=1e-4, rtol=1e-4)
        head.config.logits_top_k = 0
        np.testing.assert_allclose(np.array(head.logits(state, mx.array(hidden[None])))[0], want,
                                   atol=1e-4, rtol=1e-4)
        head.config.logits_top_k = 50
    # Beam search: the same beams, and each drafted token's probability.
    for width, length in [(1, 5), (3, 4), (5, 3)]:
        ref_beams, ref_logp = apple_beam_search(w, cfg, hidden, 7, table, width, length)
        drafts = beam_search(head, lm.model.model.embed_tokens, mx.array(hidden[None]),
                             mx.array([7]), width, length)
        np.testing.assert_array_equal(np.array(drafts.beams[0]), ref_beams)
        np.testing.assert_allclose(np.array(drafts.confidence[0]), np.exp(ref_logp), atol=1e-4)


def nn_log_softmax(x):
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def test_redrafter_with_the_imported_head_writes_ar_s_answer(tmp_path, model_dir):
    _, _, out = import_head(tmp_path, model_dir, rnn=True, exit_dim=96)
    engine = Engine.load(str(model_dir), drafter=str(out))
    for prompt in ([5, 17, 42, 3], [60, 61, 9, 9, 9, 33, 71]):
        want = [t for e in engine.generate_ids(prompt, "ar", GenerationParams(max_tokens=24))
                if e.kind == "token" for t in e.tokens]
        for width, length in [(1, 4), (3, 5)]:
            params = GenerationParams(max_tokens=24, options={"beam_width": width, "beam_length": length,
                                                              "draft_cutoff": 0.0, "lookup": 0})
            got = [t for e in engine.generate_ids(prompt, "redrafter", params) if e.kind == "token"
                   for t in e.tokens]
            assert got == want


def run_import(capsys, src, model_dir, out):
    status = main(["import-drafter", str(src), "--model", str(model_dir), "-o", str(out)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 1 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_import_errors_are_one_line(tmp_path, model_dir, capsys):
    out = tmp_path / "head"
    write_apple_checkpoint(tmp_path / "medusa", model_type="medusa")
    assert "model_type is 'medusa'" in run_import(capsys, tmp_path / "medusa", model_dir, out)
    write_apple_checkpoint(tmp_path / "h32", hidden=32)
    assert "hidden_size is 32" in run_import(capsys, tmp_path / "h32", model_dir, out)
    write_apple_checkpoint(tmp_path / "v50", vocab=50)
    assert "vocab_size is 50" in run_import(capsys, tmp_path / "v50", model_dir, out)
    _, weights = write_apple_checkpoint(tmp_path / "norw")
    del weights["rnn_w.weight"]
    save_file(weights, str(tmp_path / "norw" / "model.safetensors"))
    assert "lack rnn_w.weight" in run_import(capsys, tmp_path / "norw", model_dir, out)
    write_apple_checkpoint(tmp_path / "bin")
    (tmp_path / "bin" / "model.safetensors").rename(tmp_path / "bin" / "pytorch_model.bin")
    refused = run_import(capsys, tmp_path / "bin", model_dir, out)  # not a torch zip: the reader says so
    assert "pytorch_model.bin" in refused and len(refused.strip().splitlines()) == 1
    assert "no drafter directory" in run_import(capsys, tmp_path / "nowhere", model_dir, out)
    assert not out.exists()
    _, _, made = import_head(tmp_path, model_dir)
    capsys.readouterr()
    assert "already holds a head" in run_import(capsys, tmp_path / "apple", model_dir, made)
