"""Read PyTorch checkpoints (`pytorch_model.bin`) without torch and without running their pickle.

`torch.save` (since torch 1.6) writes a zip: `<prefix>/data.pkl`, a pickle of the state dict whose
tensors point at storages by key, and one member `<prefix>/data/<key>` per storage: the raw
elements, little-endian unless `<prefix>/byteorder` says otherwise.

A pickle may name any importable callable and call it (`os.system`, `builtins.exec`): loading one
with `pickle.load` runs whatever its author wrote. Here the pickle is read by an unpickler whose
`find_class` knows only the few globals a state dict of tensors needs, each mapped to a stand-in of
our own that records numbers; any other global is refused by name, never imported. Storages are
read lazily: a stored (uncompressed) member, as torch writes them, is memory-mapped in place.
Views, offsets, strides and tensors that share a storage come out as torch would give them.
bfloat16 (which numpy lacks) is read as its uint16 bits and viewed as MLX bfloat16.

The legacy (pre-1.6, non-zip) format and any other file are refused with one line.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Iterator, Tuple

import numpy as np

from ..errors import CorruptModel, UnsupportedModel

# torch's storage class name -> (dtype name, numpy dtype of the stored elements)
STORAGE_DTYPES = {
    "HalfStorage": ("float16", np.float16),
    "BFloat16Storage": ("bfloat16", np.uint16),  # numpy has no bfloat16: read the bits
    "FloatStorage": ("float32", np.float32),
    "DoubleStorage": ("float64", np.float64),
    "LongStorage": ("int64", np.int64),
    "IntStorage": ("int32", np.int32),
    "ShortStorage": ("int16", np.int16),
    "CharStorage": ("int8", np.int8),
    "ByteStorage": ("uint8", np.uint8),
    "BoolStorage": ("bool", np.bool_),
}

# The first bytes of the legacy format: a pickled protocol-2 long, torch's magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


class _Sealed:
    """A stand-in the pickle cannot change: BUILD (`__setstate__`) would let it rewrite a shape or a
    storage after the checks below, and so read past a storage."""

    __slots__ = ()

    def __setstate__(self, state):
        raise CorruptModel(f"the pickle tries to set the state of a {type(self).__name__}")


class StorageType(_Sealed):
    """Stand-in for `torch.HalfStorage` and its kin: only says which dtype a storage holds."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class TensorRef(_Sealed):
    """A tensor as the pickle describes it: a storage, an offset, a shape and strides (in elements)."""

    __slots__ = ("storage", "offset", "shape", "stride")

    def __init__(self, storage: "Storage", offset: int, shape: Tuple[int, ...], stride: Tuple[int, ...]):
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    def numpy(self) -> np.ndarray:
        """A contiguous native-endian copy; bfloat16 as its uint16 bits."""
        base = self.storage.array()
        native = base.dtype.newbyteorder("=")
        if 0 in self.shape:
            return np.empty(self.shape, native)
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        if last >= base.size:  # checked at rebuild too; as_strided itself would read any memory
            raise CorruptModel(f"a tensor of shape {self.shape} reaches past its storage "
                               f"in {self.storage.checkpoint.path}")
        item = base.dtype.itemsize
        try:  # a stride of 0 lets a few stored elements claim any size
            view = np.lib.stride_tricks.as_strided(base[self.offset:], self.shape, [s * item for s in self.stride],
                                                   writeable=False)
            return np.array(view, dtype=native, order="C")
        except (MemoryError, ValueError, OverflowError) as exc:
            raise CorruptModel(f"cannot make a tensor of shape {self.shape} from "
                               f"{self.storage.checkpoint.path}: {_one_line(exc)}") from None

    def to_mlx(self):
        import mlx.core as mx

        array = mx.array(self.numpy())
        return array.view(mx.bfloat16) if self.dtype == "bfloat16" else array


class Storage(_Sealed):
    """One `data/<key>` member, read on first use."""

    __slots__ = ("checkpoint", "key", "numel", "dtype", "numpy_dtype", "_array")

    def __init__(self, checkpoint: "TorchCheckpoint", key: str, kind: StorageType, numel: int):
        self.checkpoint, self.key, self.numel = checkpoint, key, numel
        self.dtype, numpy_dtype = STORAGE_DTYPES[kind.name]
        self.numpy_dtype = np.dtype(numpy_dtype).newbyteorder(checkpoint.byteorder)
        self._array = None

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = self.checkpoint.read_storage(self.key, self.numpy_dtype, self.numel)
        return self._array


def _ints(value, what: str) -> Tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise CorruptModel(f"a tensor's {what} is {value!r}, not a tuple of sizes")
    return tuple(value)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None) -> TensorRef:
    """Stand-in for `torch._utils._rebuild_tensor_v2`: checks the view lies inside its storage."""
    if not isinstance(storage, Storage) or type(storage_offset) is not int or storage_offset < 0:
        raise CorruptModel("a tensor does not point at a storage")
    shape, strides = _ints(size, "shape"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise CorruptModel(f"a tensor has shape {shape} but strides {strides}")
    last = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides))
    if 0 not in shape and last >= storage.numel:
        raise CorruptModel(f"a tensor of shape {shape} reaches past its storage of {storage.numel} elements")
    return TensorRef(storage, storage_offset, shape, strides)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    """Stand-in for `torch._utils._rebuild_parameter(_with_state)`: a parameter is its tensor."""
    if not isinstance(data, TensorRef):
        raise CorruptModel("a parameter does not hold a tensor")
    return data


ALLOWED_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): StorageType(name) for name in STORAGE_DTYPES},
}


class RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        self.qualified = ascii(f"{module}.{name}")[1:-1][:120]  # STACK_GLOBAL's names may hold newlines
        super().__init__(self.qualified)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, checkpoint: "TorchCheckpoint"):
        super().__init__(io.BytesIO(data))
        self.checkpoint = checkpoint

    def find_class(self, module: str, name: str):
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise RefusedGlobal(str(module), str(name)) from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], StorageType)
                and isinstance(pid[2], str) and type(pid[4]) is int and pid[4] >= 0):
            raise CorruptModel(f"unknown persistent id {str(pid)[:80]!r}")
        return self.checkpoint.storage(pid[2], pid[1], pid[4])


class TorchCheckpoint:
    """The tensors of one torch.save zip: `names()`, `[name]` -> TensorRef, `items()`."""

    def __init__(self, path):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(len(_LEGACY_MAGIC))
        if head == _LEGACY_MAGIC:
            raise UnsupportedModel(f"{self.path} is in PyTorch's legacy (pre-1.6) format; pickled .bin weights "
                                   "are read only in torch.save's zip format: re-save it, or as safetensors")
        if not head.startswith(b"PK\x03\x04"):
            raise UnsupportedModel(f"{self.path} is not a PyTorch checkpoint; pickled .bin weights are read only "
                                   "in torch.save's zip format")
        try:
            self.zip = zipfile.ZipFile(self.path)
            pickles = [n for n in self.zip.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise CorruptModel(f"{self.path} is a zip but not a PyTorch checkpoint (no <name>/data.pkl)")
            self.prefix = pickles[0][: -len("data.pkl")]
            order = self._member("byteorder")
            self.byteorder = "<" if order is None else {b"little": "<", b"big": ">"}.get(order.strip())
            if self.byteorder is None:
                raise CorruptModel(f"{self.path} has an unknown byteorder {order[:20]!r}")
            data = self.zip.read(pickles[0])
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as exc:
            raise CorruptModel(f"truncated or corrupt PyTorch checkpoint {self.path}: {_one_line(exc)}") from None
        self._storages: Dict[str, Storage] = {}
        try:
            state = _RestrictedUnpickler(data, self).load()
        except RefusedGlobal as exc:
            raise UnsupportedModel(f"refused {self.path}: its pickle names {exc.qualified}, which is not part of "
                                   "a state dict of tensors (a pickle can run any code: it was neither imported "
                                   "nor run)") from None
        except CorruptModel as exc:
            raise CorruptModel(f"corrupt PyTorch checkpoint {self.path}: {exc}") from None
        except Exception as exc:  # any malformed pickle: one line, no traceback
            raise CorruptModel(f"corrupt PyTorch checkpoint {self.path}: {type(exc).__name__}: "
                               f"{_one_line(exc)}") from None
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise UnsupportedModel(f"{self.path} holds a {type(state).__name__}, not a state dict of named tensors")
        self.tensors: Dict[str, TensorRef] = {k: v for k, v in state.items() if isinstance(v, TensorRef)}
        if len(self.tensors) != len(state):
            odd = next(k for k, v in state.items() if not isinstance(v, TensorRef))
            raise UnsupportedModel(f"{self.path}: {odd!r} is a {type(state[odd]).__name__}, not a tensor")

    def _member(self, name: str):
        try:
            return self.zip.read(self.prefix + name)
        except KeyError:
            return None

    def storage(self, key: str, kind: StorageType, numel: int) -> Storage:
        """One handle per key: tensors that share a storage share it here too."""
        known = self._storages.get(key)
        if known is None:
            known = self._storages[key] = Storage(self, key, kind, numel)
        elif STORAGE_DTYPES[kind.name][0] != known.dtype or numel != known.numel:
            raise CorruptModel(f"storage {key} is described twice, differently")
        return known

    def read_storage(self, key: str, dtype: np.dtype, numel: int) -> np.ndarray:
        name = f"{self.prefix}data/{key}"
        try:
            info = self.zip.getinfo(name)
        except KeyError:
            raise CorruptModel(f"{self.path} lacks storage {name}") from None
        need = numel * dtype.itemsize
        if info.file_size < need:
            raise CorruptModel(f"storage {name} in {self.path} has {info.file_size} bytes, needs {need}")
        if numel == 0:
            return np.empty(0, dtype)
        if info.compress_type == zipfile.ZIP_STORED:
            with open(self.path, "rb") as f:  # the local header: its name and extra field precede the data
                f.seek(info.header_offset)
                local = f.read(30)
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                raise CorruptModel(f"truncated or corrupt PyTorch checkpoint {self.path} (at {name})")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            if start + need > self.size:
                raise CorruptModel(f"truncated PyTorch checkpoint {self.path}: {name} ends past the file")
            return np.memmap(self.path, dtype=dtype, mode="r", offset=start, shape=(numel,))
        try:
            raw = self.zip.read(name)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise CorruptModel(f"corrupt PyTorch checkpoint {self.path} at {name}: {_one_line(exc)}") from None
        return np.frombuffer(raw, dtype=dtype, count=numel)

    def names(self):
        return list(self.tensors)

    def __getitem__(self, name: str) -> TensorRef:
        return self.tensors[name]

    def items(self) -> Iterator[Tuple[str, TensorRef]]:
        return iter(self.tensors.items())

    def close(self) -> None:
        self.zip.close()

    def __enter__(self) -> "TorchCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load_torch_checkpoint(path) -> Dict[str, "object"]:
    """Every tensor of a torch.save zip as an MLX array (bfloat16 stays bfloat16)."""
    with TorchCheckpoint(path) as checkpoint:
        return {name: ref.to_mlx() for name, ref in checkpoint.items()}
