"""Convert a PyTorch model directory (`pytorch_model.bin`, or `pytorch_model-0000N-of-0000M.bin`
shards with `pytorch_model.bin.index.json`, as Vicuna's official repos ship) into an MLX one:
`model-0000N-of-0000M.safetensors` (one per source shard) + `model.safetensors.index.json`, with the
config and tokenizer files copied. The pickles are read by `torch_checkpoint` (no torch, no code run).

Shard by shard: at most one shard's tensors are in memory. Each output shard is written under
`.partial/` and renamed into place, so a conversion stopped by Ctrl-C resumes at the first shard
not yet converted; the index is written last and marks the directory complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import CorruptModel, ModelNotFound, UnsupportedModel
from .default import home
from .torch_checkpoint import TorchCheckpoint

TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SINGLE = "pytorch_model.bin"
INDEX = "model.safetensors.index.json"
COPIED = ("*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja", "README.md")  # as download_repo fetches
# (the card: an official APAR checkpoint whose tokenizer lacks its two control tokens is known by it)
DTYPES = ("float16", "bfloat16", "float32", "as-is")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def torch_shards(src: Path) -> List[Tuple[str, Optional[List[str]]]]:
    """The checkpoint's files in order, each with the tensors the index puts there (None: all it
    holds, for a single `pytorch_model.bin`); [] when `src` has neither layout."""
    index_file = src / TORCH_INDEX
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            assert isinstance(weight_map, dict) and weight_map
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
        except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise CorruptModel(f"{index_file} is not a valid index (a JSON object with a weight_map)") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if Path(name).name != name or name in (".", ".."):
                raise CorruptModel(f"{index_file} names {name!r}, which is not a file beside it")
            if not (src / name).is_file():
                raise ModelNotFound(f"{src} lacks {name}, a shard its {TORCH_INDEX} names")
        return [(name, [k for k, v in weight_map.items() if v == name]) for name in files]
    if (src / TORCH_SINGLE).is_file():
        return [(TORCH_SINGLE, None)]
    return []


def cache_dir_for(src: Path, dtype: str = "float16", name: Optional[str] = None) -> Path:
    """Where the loader keeps `src`'s conversion: named `name` (default: the directory's) and after
    the source's path, files, sizes and times, so a changed checkpoint converts anew."""
    key = hashlib.sha256(f"{src.resolve()}\n{dtype}".encode())
    for file in [TORCH_INDEX, TORCH_SINGLE] + [file for file, _ in torch_shards(src)]:
        if (src / file).is_file():
            stat = (src / file).stat()
            key.update(f"\n{file} {stat.st_size} {stat.st_mtime_ns}".encode())
    return home() / "models" / f"{name or src.name}-from-torch-{dtype}-{key.hexdigest()[:12]}"


def converted_torch_dir(src: Path, dtype: str = "float16", progress: bool = True,
                        name: Optional[str] = None) -> Path:
    """`src` itself when it has safetensors weights or no PyTorch checkpoint; otherwise its MLX
    conversion in the cache, made on first use (`name`: the conversion's name, for a downloaded
    snapshot whose directory is a commit hash)."""
    if any(src.glob("*.safetensors")) or not torch_shards(src):
        return src
    out = cache_dir_for(src, dtype, name)
    if not (out / INDEX).is_file():
        if progress:
            _stderr(f"Converting the PyTorch checkpoint in {src} -> {out} ({dtype}, once)...")
        convert_torch_dir(src, out, dtype=dtype, progress=progress)
    return out


def after_shard(number: int, path: Path) -> None:
    """Called once each output shard is in place (a test interrupts a conversion here)."""


def convert_torch_dir(src, out, dtype: str = "float16", progress: bool = True,
                      log: Callable[[str], None] = _stderr) -> Path:
    """Convert `src` into `out` (see the module's doc); floating tensors become `dtype` ("as-is"
    keeps them), others stay as they are. Shards already in `out` are kept."""
    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise UnsupportedModel(f"unknown dtype {dtype!r} (choose {', '.join(DTYPES)})")
    shards = torch_shards(src)
    if not shards:
        raise ModelNotFound(f"{src} has neither {TORCH_INDEX} nor {TORCH_SINGLE}")
    partial = out / ".partial"  # made at the first write: a checkpoint refused leaves no directory
    count, weight_map, total = len(shards), {}, 0
    for number, (name, names) in enumerate(shards, 1):
        target = out / f"model-{number:05d}-of-{count:05d}.safetensors"
        desc = f"{src.name}: shard {number}/{count}"
        sizes = _done_shard(target, names)
        if sizes is not None:
            if progress:
                log(f"{desc}: already converted")
        else:
            arrays = _convert_shard(src / name, names, dtype, desc, progress, log)
            import mlx.core as mx

            partial.mkdir(parents=True, exist_ok=True)
            staging = partial / f"{os.getpid()}-{target.name}"
            mx.save_safetensors(str(staging), arrays, metadata={"format": "mlx"})
            os.replace(staging, target)  # atomic: a shard under its final name is complete
            sizes = {k: v.nbytes for k, v in arrays.items()}
            del arrays
        weight_map.update(dict.fromkeys(sizes, target.name))
        total += sum(sizes.values())
        after_shard(number, target)
    for pattern in COPIED:
        for file in sorted(src.glob(pattern)):
            if file.is_file() and file.name not in (TORCH_INDEX, INDEX):
                shutil.copyfile(file, out / file.name)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    partial.mkdir(parents=True, exist_ok=True)
    staging = partial / f"{os.getpid()}-{INDEX}"
    staging.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(staging, out / INDEX)  # last: the directory is complete
    shutil.rmtree(partial, ignore_errors=True)
    if progress:  # one shard held at a time: the peak is about the largest shard, not the model
        import mlx.core as mx

        log(f"{src.name}: {count} shard(s), {total / 1e9:.2f} GB written; peak MLX memory "
            f"{mx.get_peak_memory() / 1e6:.0f} MB")
    return out


def _convert_shard(path: Path, names: Optional[List[str]], dtype: str, desc: str, progress: bool,
                   log: Callable[[str], None]) -> Dict[str, object]:
    import mlx.core as mx

    from ..redrafter_head.progress import Progress

    with TorchCheckpoint(path) as checkpoint:
        names = checkpoint.names() if names is None else names
        missing = [k for k in names if k not in checkpoint.tensors]
        if missing:
            raise CorruptModel(f"{path} lacks {missing[0]!r}, which the index puts there")
        bar = Progress(len(names), desc, "tensor", enabled=progress, log=log)
        arrays = {}
        for name in names:
            array = checkpoint[name].to_mlx()
            if dtype != "as-is" and mx.issubdtype(array.dtype, mx.floating):
                array = array.astype(getattr(mx, dtype))
            mx.eval(array)  # now, so the numpy copy it was made from is freed
            arrays[name] = array
            bar.update()
        bar.close()
    return arrays


def _done_shard(target: Path, names: Optional[List[str]]) -> Optional[Dict[str, int]]:
    """The byte size of each tensor of an output shard already converted (its header read), or None
    when there is none to keep."""
    try:
        with open(target, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    if names is not None and set(names) != set(sizes):
        return None
    return sizes
