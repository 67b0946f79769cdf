"""PyTorch checkpoints read without torch and without running their pickle (torch_checkpoint.py), and
converted into MLX safetensors (torch_convert.py). The fixtures were written by real torch.save
(tests/fixtures/torch_ckpt/make_fixtures.py), with their expected values in .npz files."""

import json
import shutil
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.errors import CorruptModel, UnsupportedModel, UserError, run_guarded
from mlx_specdec.model import torch_convert
from mlx_specdec.model.loader import check_weights, read_config, resolve_model_path
from mlx_specdec.model.torch_checkpoint import Storage, TorchCheckpoint, load_torch_checkpoint
from mlx_specdec.model.torch_convert import INDEX, convert_torch_dir

FIX = Path(__file__).parent / "fixtures" / "torch_ckpt"
VICUNA = FIX / "vicuna_sharded"
SHARDS = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def assert_bit_exact(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(bits(got), bits(want))


def one_line_error(capsys, path) -> str:
    """The CLI's own guard around a load: exit 1 and a single `error:` line, no traceback."""
    assert run_guarded(lambda _: TorchCheckpoint(path), None) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("name", ["bf16", "f32", "shared", "noncontig"])
def test_every_tensor_loads_bit_exact(name):
    want = np.load(FIX / f"{name}.npz")
    with TorchCheckpoint(FIX / f"{name}.bin") as checkpoint:
        assert sorted(checkpoint.names()) == sorted(want.files)
        for key in want.files:
            assert_bit_exact(checkpoint[key].numpy(), want[key])


def test_the_vicuna_shards_load_bit_exact():
    want = np.load(FIX / "vicuna_sharded.npz")
    index = json.loads((VICUNA / "pytorch_model.bin.index.json").read_text())["weight_map"]
    seen = set()
    for shard in SHARDS:
        with TorchCheckpoint(VICUNA / shard) as checkpoint:
            assert {k for k, v in index.items() if v == shard} == set(checkpoint.names())
            for key, ref in checkpoint.items():
                assert_bit_exact(ref.numpy(), want[key])
                assert ref.dtype == ("float32" if key.endswith("inv_freq") else "float16")
            seen |= set(checkpoint.names())
    assert seen == set(want.files)


def test_views_share_one_mapped_storage_and_tied_keys_one_tensor():
    with TorchCheckpoint(FIX / "shared.bin") as checkpoint:
        storages = {k: checkpoint[k].storage for k in ("base", "slice", "row", "column")}
        assert len({id(s) for s in storages.values()}) == 1 and isinstance(storages["base"], Storage)
        assert isinstance(storages["base"].array(), np.memmap)  # a stored member is mapped, not read
        assert checkpoint["slice"].offset == 8 and checkpoint["column"].stride == (6,)
        assert checkpoint["tied_a"] is checkpoint["tied_b"]
    with TorchCheckpoint(FIX / "noncontig.bin") as checkpoint:
        assert checkpoint["expanded"].stride == (0, 1) and checkpoint["transposed"].stride == (1, 5)


def test_bfloat16_becomes_mlx_bfloat16_with_the_same_bits():
    want = np.load(FIX / "bf16.npz")
    arrays = load_torch_checkpoint(FIX / "bf16.bin")
    for key in want.files:
        assert arrays[key].dtype == mx.bfloat16
        np.testing.assert_array_equal(np.array(arrays[key].view(mx.uint16)), want[key])
    assert load_torch_checkpoint(FIX / "f32.bin")["position_ids"].dtype == mx.int64


def rewrite(src: Path, dst: Path, compression=zipfile.ZIP_STORED, member=lambda name, raw: raw) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, member(info.filename, zin.read(info.filename)))
    return dst


def test_deflated_members_and_big_endian_storages_read_the_same(tmp_path):
    want = np.load(FIX / "f32.npz")
    deflated = rewrite(FIX / "f32.bin", tmp_path / "deflated.bin", zipfile.ZIP_DEFLATED)
    with TorchCheckpoint(FIX / "f32.bin") as checkpoint:
        for key in want.files:
            checkpoint[key].numpy()
        itemsize = {s.key: s.numpy_dtype.itemsize for s in checkpoint._storages.values()}

    def big_endian(name, raw):
        if name.endswith("/byteorder"):
            return b"big"
        key = name.rsplit("/", 1)[-1]
        if "/data/" in name and key in itemsize:
            return np.frombuffer(raw, f"<u{itemsize[key]}").byteswap().tobytes()
        return raw

    swapped = rewrite(FIX / "f32.bin", tmp_path / "big.bin", member=big_endian)
    for path in (deflated, swapped):
        with TorchCheckpoint(path) as checkpoint:
            for key in want.files:
                assert_bit_exact(checkpoint[key].numpy(), want[key])


@pytest.mark.parametrize("name, says", [
    ("hostile_os_system", "its pickle names os.system"),
    ("hostile_exec", "its pickle names builtins.exec"),
    ("hostile_import", "its pickle names this.s"),
    ("hostile_build", "tries to set the state of a TensorRef"),
])
def test_a_hostile_pickle_is_refused_and_nothing_of_it_runs(name, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where the payloads would write their pwned-* markers
    imported = "this" in sys.modules
    err = one_line_error(capsys, FIX / f"{name}.bin")
    assert says in err
    assert not list(tmp_path.glob("pwned-*")) and not list(Path.cwd().glob("pwned-*"))
    assert imported or "this" not in sys.modules  # refused by name, never imported


@pytest.mark.parametrize("name, says", [
    ("legacy", "legacy (pre-1.6) format"),
    ("truncated", "truncated or corrupt PyTorch checkpoint"),
])
def test_legacy_and_truncated_files_are_refused_in_one_line(name, says, capsys):
    assert says in one_line_error(capsys, FIX / f"{name}.bin")


def test_other_files_are_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "junk.bin").write_bytes(b"\x80\x04not really a pickle")
    assert "not a PyTorch checkpoint" in one_line_error(capsys, tmp_path / "junk.bin")
    rewrite(FIX / "f32.bin", tmp_path / "cut.bin", member=lambda n, raw: raw[:3] if "/data/" in n else raw)
    with pytest.raises(CorruptModel, match="has 3 bytes, needs"):
        load_torch_checkpoint(tmp_path / "cut.bin")


def read_shards(out: Path) -> dict:
    arrays = {}
    for file in sorted(out.glob("model-*.safetensors")):
        arrays.update(mx.load(str(file)))
    return arrays


def test_the_vicuna_checkpoint_converts_to_float16_safetensors_that_mlx_lm_loads(tmp_path):
    from mlx_lm.utils import load_model

    out = convert_torch_dir(VICUNA, tmp_path / "out", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", INDEX]
    source = json.loads((VICUNA / "pytorch_model.bin.index.json").read_text())["weight_map"]
    index = json.loads((out / INDEX).read_text())
    assert index["weight_map"] == {k: v.replace("pytorch_model", "model").replace(".bin", ".safetensors")
                                   for k, v in source.items()}
    want = np.load(FIX / "vicuna_sharded.npz")
    arrays = read_shards(out)
    assert set(arrays) == set(want.files)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
    for key, array in arrays.items():
        assert array.dtype == mx.float16
        assert_bit_exact(np.array(array), want[key].astype(np.float16))  # inv_freq was float32
    model, _ = load_model(out)  # strict: every weight in place
    np.testing.assert_array_equal(np.array(model.model.layers[1].mlp.up_proj.weight),
                                  want["model.layers.1.mlp.up_proj.weight"])


def test_a_single_pytorch_model_bin_converts_as_is(tmp_path, capsys):
    src = tmp_path / "single"
    src.mkdir()
    shutil.copy(FIX / "f32.bin", src / "pytorch_model.bin")
    out = convert_torch_dir(src, tmp_path / "out", dtype="as-is")
    assert "single: shard 1/1: 5/5 tensors" in capsys.readouterr().err  # one progress line per shard
    want = np.load(FIX / "f32.npz")
    arrays = read_shards(out)
    assert list(out.glob("*.safetensors")) == [out / "model-00001-of-00001.safetensors"]
    for key in want.files:
        assert_bit_exact(np.array(arrays[key]), want[key])


def test_an_interrupted_conversion_resumes_and_ends_the_same(tmp_path, monkeypatch):
    whole = convert_torch_dir(VICUNA, tmp_path / "whole", progress=False)
    out = tmp_path / "out"

    def ctrl_c_after_the_first(number, path):
        if number == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(torch_convert, "after_shard", ctrl_c_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        convert_torch_dir(VICUNA, out, progress=False)
    first = out / "model-00001-of-00002.safetensors"
    assert first.exists() and not (out / "model-00002-of-00002.safetensors").exists() and not (out / INDEX).exists()
    kept = first.stat()
    (out / ".partial" / "999-model-00002-of-00002.safetensors").write_bytes(b"half a shard")  # a kill mid-write

    converted = []
    real = torch_convert._convert_shard
    monkeypatch.setattr(torch_convert, "_convert_shard", lambda path, *a: converted.append(path.name) or real(path, *a))
    monkeypatch.setattr(torch_convert, "after_shard", lambda number, path: None)
    convert_torch_dir(VICUNA, out, progress=False)
    assert converted == [SHARDS[1]]
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in whole.iterdir())  # no .partial
    for file in whole.iterdir():
        assert (out / file.name).read_bytes() == file.read_bytes(), file.name


def test_the_loader_converts_a_torch_directory_once_into_the_cache(tmp_path, home, capsys):
    from conftest import make_tiny_tokenizer
    from mlx_specdec.model.loader import load_model

    src = Path(shutil.copytree(VICUNA, tmp_path / "vicuna-tiny"))
    make_tiny_tokenizer(vocab_size=32)._tokenizer.save_pretrained(str(src))
    path = resolve_model_path(str(src))
    assert path.parent == home / "models" and path.name.startswith("vicuna-tiny-from-torch-float16-")
    err = capsys.readouterr().err
    assert "Converting the PyTorch checkpoint" in err and "shard 2/2" in err
    assert resolve_model_path(str(src)) == path and capsys.readouterr().err == ""  # once
    assert read_config(path)["model_type"] == "llama" and (path / "tokenizer.json").exists()
    check_weights(path)
    lm = load_model(str(src), dtype="float32")
    want = np.load(FIX / "vicuna_sharded.npz")["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.array(lm.model.model.embed_tokens.weight), want.astype(np.float32))


def test_the_loader_refuses_a_hostile_pytorch_model_bin_and_leaves_no_cache(tmp_path, home, monkeypatch):
    src = tmp_path / "evil"
    src.mkdir()
    shutil.copy(VICUNA / "config.json", src / "config.json")
    shutil.copy(FIX / "hostile_os_system.bin", src / "pytorch_model.bin")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedModel) as refused:
        resolve_model_path(str(src))
    assert "os.system" in str(refused.value) and "\n" not in str(refused.value)
    assert isinstance(refused.value, UserError)
    assert not list(tmp_path.glob("pwned-*")) and not (home / "models").exists()
