"""`--model owner/name`: what `download_repo` asks the Hub for, and what becomes of it, with the Hub
played by a local directory (huggingface_hub's calls monkeypatched: no network).

A repo with safetensors gives those; one without (lmsys/vicuna-7b-v1.5 ships
`pytorch_model-0000N-of-0000M.bin` + `pytorch_model.bin.index.json` and `tokenizer.model`, no
tokenizer.json) gives its `.bin` shards, converted once into the cache. Never any other pickle.
Offline, the local cache serves (safetensors first, then `.bin`); offline and not cached, or no such
repo: one line, no traceback."""

import fnmatch
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import mlx.core as mx
import numpy as np
import pytest
from huggingface_hub.utils import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

from mlx_specdec.errors import ModelNotFound, UnsupportedModel, UserError, run_guarded
from mlx_specdec.model.loader import (REPO_FILES, SAFETENSORS_WEIGHTS, TORCH_WEIGHTS, load_model,
                                      resolve_model_path)

from vicuna_helpers import FIX, VICUNA_SPECIAL_TOKENS_MAP, VICUNA_TOKENIZER_CONFIG, train_tokenizer_model

REPO = "lmsys/vicuna-tiny"


def hub_error(cls, message):
    error = cls.__new__(cls)  # its __init__ wants an HTTP response
    Exception.__init__(error, message)
    return error


class FakeHub:
    """Repos (id -> a directory laid out as the repo), served as huggingface_hub would; each call
    recorded: (repo, "model_info"), or a snapshot_download's (repo, allow_patterns, local_files_only). `online=False`: every request fails as with
    no network, and only snapshots already fetched (or put in `cached`) are served from the cache."""

    def __init__(self, root: Path):
        self.root, self.repos, self.calls, self.online, self.cached = root, {}, [], True, {}

    def model_info(self, repo_id, **kwargs):
        self.calls.append((repo_id, "model_info"))
        if not self.online:
            raise ConnectionError("[Errno -2] Name or service not known")
        if repo_id not in self.repos:
            raise hub_error(RepositoryNotFoundError, f"404 Client Error. Repository Not Found for url: {repo_id}")
        if repo_id.startswith("gated/"):
            raise hub_error(GatedRepoError, "403 Client Error. Cannot access gated repo")
        files = sorted(str(p.relative_to(self.repos[repo_id])) for p in self.repos[repo_id].rglob("*") if p.is_file())
        return SimpleNamespace(siblings=[SimpleNamespace(rfilename=name) for name in files])

    def snapshot_download(self, repo_id, *, allow_patterns=None, local_files_only=False, **kwargs):
        self.calls.append((repo_id, list(allow_patterns or []), local_files_only))
        if local_files_only or not self.online:
            if repo_id not in self.cached:
                raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
            return str(self.cached[repo_id])  # the snapshot as cached, whatever the patterns
        source = self.repos[repo_id]
        snapshot = self.root / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "0123abcd"
        for file in sorted(source.rglob("*")):
            name = str(file.relative_to(source))
            wanted = any(fnmatch.fnmatch(name, p) for p in allow_patterns or ["*"])
            if file.is_file() and wanted and not (snapshot / name).exists():  # a file once fetched stays as it is
                (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(file, snapshot / name)
        self.cached[repo_id] = snapshot
        return str(snapshot)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "model_info", fake.model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    return fake


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory):
    return train_tokenizer_model(tmp_path_factory.mktemp("spm"))


def vicuna_repo(path: Path, tokenizer_model: Path) -> Path:
    """The 2-shard fixture laid out as lmsys/vicuna-7b-v1.5 is, with a pickle that is not weights."""
    shutil.copytree(FIX / "vicuna_sharded", path)
    shutil.copy(tokenizer_model, path / "tokenizer.model")
    (path / "tokenizer_config.json").write_text(json.dumps(VICUNA_TOKENIZER_CONFIG))
    (path / "special_tokens_map.json").write_text(json.dumps(VICUNA_SPECIAL_TOKENS_MAP))
    (path / "README.md").write_text("# Vicuna Model Card\n")
    (path / ".gitattributes").write_text("*.bin filter=lfs diff=lfs merge=lfs -text\n")
    (path / "training_args.bin").write_bytes((FIX / "hostile_os_system.bin").read_bytes())
    return path


def one_line(capsys, spec) -> str:
    assert run_guarded(lambda _: resolve_model_path(spec), None) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_repo_of_pytorch_shards_downloads_them_and_loads_converted(tmp_path, home, hub, tokenizer_model, capsys):
    hub.repos[REPO] = vicuna_repo(tmp_path / "repo", tokenizer_model)
    path = resolve_model_path(REPO)
    assert hub.calls == [(REPO, "model_info"), (REPO, REPO_FILES + TORCH_WEIGHTS, False)]
    snapshot = hub.cached[REPO]
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "README.md", "config.json", "generation_config.json", "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json", "special_tokens_map.json",
        "tokenizer.model", "tokenizer_config.json"]  # no training_args.bin, no .gitattributes
    assert path.parent == home / "models" and path.name.startswith("lmsys--vicuna-tiny-from-torch-float16-")
    assert "Converting the PyTorch checkpoint" in capsys.readouterr().err
    assert {"tokenizer.model", "tokenizer_config.json", "README.md"} <= {p.name for p in path.iterdir()}

    lm = load_model(REPO, dtype="float32")  # the same snapshot, converted once
    assert lm.path == path and lm.name == REPO and "Converting" not in capsys.readouterr().err
    want = np.load(FIX / "vicuna_sharded.npz")["model.layers.1.mlp.up_proj.weight"]
    np.testing.assert_array_equal(np.array(lm.model.model.layers[1].mlp.up_proj.weight), want.astype(np.float32))
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    assert lm.tokenizer.encode("Hello  world") == [1] + sp.encode("Hello  world")
    assert lm.encode_prompt("Hi")[:1] == [1] and lm.tokenizer.eos_token_ids == {2}


def test_a_repo_with_safetensors_downloads_only_those(tmp_path, home, hub):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(FIX / "vicuna_sharded" / "config.json", repo / "config.json")
    mx.save_safetensors(str(repo / "model.safetensors"), {"w": mx.zeros((2,))})
    shutil.copy(FIX / "f32.bin", repo / "pytorch_model.bin")  # repos often ship both
    hub.repos["owner/both"] = repo
    path = resolve_model_path("owner/both")
    assert hub.calls == [("owner/both", "model_info"), ("owner/both", REPO_FILES + SAFETENSORS_WEIGHTS, False)]
    assert path == hub.cached["owner/both"]  # nothing to convert
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert not (home / "models").exists()


def test_offline_the_cached_snapshot_serves_safetensors_first_then_bin(tmp_path, home, hub, tokenizer_model):
    hub.repos[REPO] = vicuna_repo(tmp_path / "repo", tokenizer_model)
    online = resolve_model_path(REPO)
    hub.online, hub.calls = False, []
    assert resolve_model_path(REPO) == online  # from the cache, converted already
    assert hub.calls == [(REPO, "model_info"), (REPO, REPO_FILES + SAFETENSORS_WEIGHTS, True),
                         (REPO, REPO_FILES + TORCH_WEIGHTS, True)]

    shutil.rmtree(home / "models")  # a cached snapshot never converted: converted now, offline
    assert resolve_model_path(REPO).name == online.name


def test_offline_and_not_cached_is_one_line(hub, home, capsys):
    hub.repos[REPO] = FIX / "vicuna_sharded"
    hub.online = False
    err = one_line(capsys, REPO)
    assert "offline" in err and "not in the local cache" in err and REPO in err
    assert [call[2] for call in hub.calls[1:]] == [True, True]  # only ever the cache


@pytest.mark.parametrize("repo, says", [
    ("nobody/no-such-model", "no model 'nobody/no-such-model' on the Hugging Face Hub (RepositoryNotFoundError)"),
    ("gated/llama", "(GatedRepoError): no such repo, or it is private or gated"),
])
def test_a_missing_or_gated_repo_is_one_line(hub, home, capsys, repo, says):
    if repo.startswith("gated/"):
        hub.repos[repo] = FIX / "vicuna_sharded"
    assert says in one_line(capsys, repo)
    assert hub.calls == [(repo, "model_info")]
    with pytest.raises(ModelNotFound):
        resolve_model_path(repo)


def test_a_repo_without_usable_weights_is_one_line(tmp_path, hub, home, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text("{}")
    (repo / "consolidated.00.pth").write_bytes(b"not fetched")
    hub.repos["meta/original"] = repo
    assert "meta/original has neither safetensors nor pytorch_model*.bin weights" in one_line(capsys, "meta/original")
    assert hub.calls == [("meta/original", "model_info")]
    with pytest.raises(UnsupportedModel):
        resolve_model_path("meta/original")


def test_a_download_that_fails_midway_is_one_line(tmp_path, hub, home, capsys, monkeypatch):
    hub.repos[REPO] = FIX / "vicuna_sharded"

    def cut(repo_id, **kwargs):
        raise OSError("Connection reset by peer\nwhile reading pytorch_model-00002-of-00002.bin")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cut)
    err = one_line(capsys, REPO)
    assert "cannot download 'lmsys/vicuna-tiny' from the Hugging Face Hub (OSError: Connection reset by peer)" in err
    with pytest.raises(UserError):
        load_model(REPO)
