"""Bad input ends in one clear line on stderr and a non-zero exit, never a traceback."""

import os
import subprocess
import sys

import pytest

from conftest import save_tiny_model_dir


def cli(*args, env=None, stdin=None):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "mlx_specdec.cli", *args], capture_output=True,
                          text=True, env=full_env, input=stdin, timeout=120)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", context=16)


@pytest.fixture
def isolated_home(tmp_path):
    return {"MLX_SPECDEC_HOME": str(tmp_path / "home")}


def test_tiny_model_directory_generates(tiny_dir):
    result = cli("generate", "-m", str(tiny_dir), "-p", "w5 w6 w7", "--raw", "--max-tokens", "4", "--temp", "0")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == 4
    assert "[ar] prompt 3 tok" in result.stderr and "decode" in result.stderr


def test_missing_model(tmp_path):
    assert_one_line_error(cli("generate", "-m", str(tmp_path / "nowhere"), "-p", "hi"), "no model at")


def test_directory_without_config(tmp_path):
    assert_one_line_error(cli("generate", "-m", str(tmp_path), "-p", "hi"), "has no config.json")


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert_one_line_error(cli("generate", "-m", str(tmp_path), "-p", "hi"),
                          "model_type 'gpt2' is not supported", "llama (Llama)", "mistral", "qwen2 (Qwen2 / Qwen2.5)",
                          "qwen3 (Qwen3)")


def test_pickled_weights_are_refused(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    assert_one_line_error(cli("generate", "-m", str(tmp_path), "-p", "hi"), "pickled .bin weights")


def test_truncated_safetensors(tmp_path, tiny_dir):
    for f in tiny_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    assert_one_line_error(cli("generate", "-m", str(tmp_path), "-p", "hi"), "corrupt safetensors", "truncated")


def test_garbage_safetensors_header(tmp_path, tiny_dir):
    for f in tiny_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    assert_one_line_error(cli("generate", "-m", str(tmp_path), "-p", "hi"), "corrupt safetensors")


def test_garbage_gguf(tmp_path, isolated_home):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(os.urandom(1000))
    assert_one_line_error(cli("generate", "-m", str(bad), "-p", "hi", env=isolated_home),
                          "cannot read GGUF file")


def test_convert_garbage_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    assert_one_line_error(cli("convert", str(bad), "-o", str(tmp_path / "out")), "GGUF")


def test_prompt_past_context_window(tiny_dir):
    prompt = " ".join(f"w{i}" for i in range(3, 20))
    assert_one_line_error(cli("generate", "-m", str(tiny_dir), "-p", prompt, "--raw"),
                          "prompt has 17 tokens but the context window", "is 16")


def test_document_and_prompt_files(tiny_dir, tmp_path):
    """--document FILE with a question, and --prompt-file: the prompt is read from the file (the
    stats line counts its tokens); a document past the window is refused before prefill."""
    doc = tmp_path / "doc.txt"
    doc.write_text("w5 w6 w7\n")
    result = cli("generate", "-m", str(tiny_dir), "--document", str(doc), "-p", "w8", "--raw", "--max-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert "prompt 4 tok" in result.stderr  # w5 w6 w7 + w8
    (tmp_path / "p.txt").write_text("w5 w6")
    result = cli("generate", "-m", str(tiny_dir), "--prompt-file", str(tmp_path / "p.txt"), "--raw", "--max-tokens", "2")
    assert result.returncode == 0 and "prompt 2 tok" in result.stderr, result.stderr
    doc.write_text(" ".join(f"w{i}" for i in range(3, 20)))
    assert_one_line_error(cli("generate", "-m", str(tiny_dir), "--document", str(doc), "-p", "w8", "--raw"),
                          "prompt has 18 tokens but the context window", "is 16")


def test_triforce_from_the_command_line(tiny_dir):
    result = cli("generate", "-m", str(tiny_dir), "-p", "w5 w6 w7 w5 w6", "--raw", "--max-tokens", "4",
                 "--method", "triforce", "--budget", "16", "--gamma", "2", "--bottom", "none")
    assert result.returncode == 0, result.stderr
    assert "[triforce]" in result.stderr
    assert_one_line_error(cli("generate", "-p", "hi", "--method", "triforce", "--bottom", "oracle"),
                          "--bottom is ngram or none or model or redrafter")
    assert_one_line_error(cli("generate", "-m", str(tiny_dir), "-p", "w5 w6", "--raw", "--method", "triforce",
                              "--bottom", "model"), "--draft-model")
    assert_one_line_error(cli("generate", "-p", "hi", "--method", "triforce", "--rebuild-below", "1.5"),
                          "--rebuild-below takes a number from 0 to 1")
    # the model as its own draft model, over a StreamingLLM window
    result = cli("generate", "-m", str(tiny_dir), "-p", "w5 w6 w7 w5 w6", "--raw", "--max-tokens", "4",
                 "--method", "triforce", "--budget", "16", "--bottom", "model", "--draft-model", str(tiny_dir))
    assert result.returncode == 0, result.stderr
    assert "[triforce]" in result.stderr


def test_bad_prompt_sources(tmp_path):
    assert_one_line_error(cli("generate", "--document", str(tmp_path / "none.txt"), "-p", "q"),
                          "--document: no such file")
    assert_one_line_error(cli("generate"), "give a prompt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    assert_one_line_error(cli("generate", "--prompt-file", str(tmp_path / "bin.txt")), "not UTF-8 text")
    assert_one_line_error(cli("generate", "--prompt-file", str(tmp_path / "bin.txt"), "-p", "x"),
                          "use it without --prompt")


def test_unknown_method():
    # checked before any model is loaded: no download, instant
    assert_one_line_error(cli("generate", "-p", "hi", "--method", "nope"), "unknown method 'nope'")


def test_unknown_bench_method(tiny_dir):
    assert_one_line_error(cli("bench", "-m", str(tiny_dir), "--methods", "ar,nope"), "unknown method 'nope'")


def test_offline_repo_id(isolated_home):
    env = dict(isolated_home, HF_HUB_OFFLINE="1", HF_HOME=isolated_home["MLX_SPECDEC_HOME"])
    assert_one_line_error(cli("generate", "-m", "lmsys/vicuna-7b-v1.5", "-p", "hi", env=env),
                          "cannot get 'lmsys/vicuna-7b-v1.5'", "offline")


def test_bad_numbers():
    assert_one_line_error(cli("generate", "-p", "hi", "--max-tokens", "0"), "--max-tokens takes a whole number from 1")
    assert_one_line_error(cli("generate", "-p", "hi", "--temp", "-1"), "--temp takes a number from 0 to 2, not -1.0")


def test_missing_prompt_file(tiny_dir, tmp_path):
    assert_one_line_error(cli("bench", "-m", str(tiny_dir), "--prompts", str(tmp_path / "none.jsonl")),
                          "none.jsonl")


def test_bad_apar_options(tiny_dir):
    assert_one_line_error(cli("generate", "-m", str(tiny_dir), "-p", "hi", "--method", "apar", "--fork-probe", "maybe"),
                          "--fork-probe is on or off, not 'maybe'")
    assert_one_line_error(cli("bench", "-m", str(tiny_dir), "--methods", "ar,apar", "--fork-probe", "on,sometimes"),
                          "--fork-probe is on or off, not 'sometimes'")
    assert_one_line_error(cli("train-fork-probe", "-m", str(tiny_dir), "--steps", "0"), "--steps and --lr must be positive")


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "convert", "fetch", "quantize", "train-fork-probe"])
def test_every_command_has_help(command):
    result = cli(command, "--help")
    assert result.returncode == 0 and "usage: mlx-specdec " + command in result.stdout
