"""Float32 weights laid out for this machine's BLAS on the CPU: row-major, or column-major.

An `nn.Linear` computes `x @ W.T` with W (out, in). Stored row-major (as mlx-lm loads it) that
reaches OpenBLAS as an "NT" GEMM; stored column-major (`contiguous(W.T).T`: the same shape and
values, its memory holding W.T row-major) as an "NN" one. Which is faster for the few rows a
decoding step has depends on the CPU and the OpenBLAS kernels it picks, and by a lot: on one
x86 machine column-major is clearly faster, on another (with AVX-512 kernels) clearly slower,
the tied vocabulary projection most of all (see docs/cpu-backend.md). So the layout is measured
on the machine, like ReDrafter's verify-cost table: at the first load of a real-sized float32 model
on the CPU, `measure_layouts` times a one-token and a three-token forward (a plain step and a
typical verify) in each layout over a few interleaved rounds, and the choice is kept in the user
cache per model and machine (`mlx-specdec calibrate` measures it again, longer). Column-major is
taken only when it is clearly faster; otherwise the weights stay as mlx-lm loads them. Tiny models
(test fixtures) are not probed. `MLX_SPECDEC_CPU_LAYOUT=row|column` overrides everything.

Either way the values are the same: the logits equal to the last bits (bit for bit where OpenBLAS
runs one kernel for both) and the same greedy tokens (tests/test_cpu_layout.py). Every method
decodes over the same laid-out weights, so greedy identity between methods does not depend on it.
Quantized layers keep MLX's own layout (they are dequantized first on the CPU when they fit:
loader.should_dequantize). Elementwise arithmetic on a weight keeps its layout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict, NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .device import machine

LAID_OUT = (nn.Linear, nn.Embedding)  # exactly these types: quantized and LoRA layers are left as they are
ROW, COLUMN = "row", "column"
LAYOUT_ENV = "MLX_SPECDEC_CPU_LAYOUT"
PROBE_MIN_PARAMS = 50_000_000  # smaller models are test fixtures: mlx-lm's layout, no probe
PROBE_CONTEXT = 150
PROBE_TOKENS = (1, 3)  # a plain decoding step and a typical ReDrafter verify
LOAD_ROUNDS = 2  # at a first load (a few seconds for the default model); `calibrate` measures more
COLUMN_MARGIN = 0.03  # column-major replaces mlx-lm's layout only when at least this much faster


class LayoutChoice(NamedTuple):
    layout: str  # ROW or COLUMN
    source: str  # why, for reports

    def describe(self) -> str:
        return f"{self.layout}-major, {self.source}"


def is_column_major(weight: mx.array) -> bool:
    """The 2-D weight's memory holds its transpose row-major (what `column_major` makes)."""
    if weight.ndim != 2:
        return False
    item = weight.itemsize
    return memoryview(weight).strides == (item, item * weight.shape[0])  # bytes; evaluates the weight


def column_major(weight: mx.array) -> mx.array:
    """The same (out, in) matrix, its memory holding (in, out) row-major: `x @ weight.T` is an NN GEMM."""
    laid = mx.contiguous(weight.T).T
    mx.eval(laid)
    return laid


def row_major(weight: mx.array) -> mx.array:
    laid = mx.contiguous(weight)
    mx.eval(laid)
    return laid


def _laid_out_weights(model: nn.Module):
    for _, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if type(module) in LAID_OUT and weight is not None and weight.dtype == mx.float32 and weight.ndim == 2:
            yield module


def store_layout(model: nn.Module, layout: str) -> int:
    """Re-lay every plain Linear / Embedding float32 weight in `layout`, in place. -> how many changed."""
    if layout not in (ROW, COLUMN):
        raise ValueError(f"unknown layout {layout!r}")
    count = 0
    for module in _laid_out_weights(model):
        if is_column_major(module.weight) == (layout == COLUMN):
            continue
        # one matrix at a time: the old copy is freed before the next
        module.weight = column_major(module.weight) if layout == COLUMN else row_major(module.weight)
        count += 1
    return count


def current_layout(model: nn.Module) -> str:
    """COLUMN if the model's float32 weights are laid out column-major (judged by the first), else ROW."""
    first = next(_laid_out_weights(model), None)
    return COLUMN if first is not None and is_column_major(first.weight) else ROW


def measure_layouts(model: nn.Module, rounds: int = LOAD_ROUNDS) -> Dict[str, float]:
    """Median over rounds of a 1-token plus a 3-token forward after PROBE_CONTEXT tokens (each the
    faster of two), per layout; the rounds interleave the layouts so a slow spell of the machine
    touches both. The model is left in the layout it came in."""
    from .timing import prefilled, verify_forward

    start = current_layout(model)
    window = getattr(getattr(model, "args", None), "max_position_embeddings", None) or PROBE_CONTEXT * 2
    cache = prefilled(model, 1, min(PROBE_CONTEXT, window - 2 * PROBE_TOKENS[-1]))  # a short model fits it too
    times: Dict[str, list] = {ROW: [], COLUMN: []}
    for _ in range(rounds):
        for layout in (ROW, COLUMN):
            store_layout(model, layout)
            verify_forward(model, cache, PROBE_TOKENS[-1])  # the new layout's first reads
            total = 0.0
            for tokens in PROBE_TOKENS:
                spans = []
                for _ in range(2):
                    begin = time.perf_counter()
                    verify_forward(model, cache, tokens)
                    spans.append(time.perf_counter() - begin)
                total += min(spans)  # the machine's speed; a spike is the machine's noise
            times[layout].append(1000 * total)
    store_layout(model, start)
    return {layout: float(np.median(ms)) for layout, ms in times.items()}


def faster_layout(measured: Dict[str, float]) -> str:
    return COLUMN if measured[COLUMN] < (1 - COLUMN_MARGIN) * measured[ROW] else ROW


def layout_path(name: str, dtype: str) -> Path:
    from .default import home

    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return home() / "cpu-layout" / f"{safe}-{dtype}.json"


def save_layout(name: str, dtype: str, measured: Dict[str, float], rounds: int) -> LayoutChoice:
    path = layout_path(name, dtype)
    layout = faster_layout(measured)
    record = {"layout": layout, "ms": {k: round(v, 2) for k, v in measured.items()}, "rounds": rounds,
              "machine": machine(), "mlx": mx.__version__,
              "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)  # a half-written choice is never read
    except OSError:
        pass  # a read-only cache: measured again at the next load
    return LayoutChoice(layout, _describe(record, path))


def stored_layout(name: str, dtype: str) -> Optional[LayoutChoice]:
    """The layout measured for this model on this machine, or None (none, another machine's, corrupt)."""
    path = layout_path(name, dtype)
    try:
        record = json.loads(path.read_text())
        if record["machine"] != machine() or record["layout"] not in (ROW, COLUMN):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return LayoutChoice(record["layout"], _describe(record, path))


def _describe(record: dict, path: Path) -> str:
    ms = record.get("ms", {})
    return (f"measured {record.get('measured_at', '?')}: 1+3-token forwards row-major {ms.get(ROW, '?')} ms, "
            f"column-major {ms.get(COLUMN, '?')} ms ({path})")


def choose_layout(model: nn.Module, name: str, dtype: str) -> LayoutChoice:
    """The layout this model's float32 weights should have on this CPU (see the module docstring)."""
    forced = os.environ.get(LAYOUT_ENV, "").strip().lower()
    if forced in (ROW, COLUMN):
        return LayoutChoice(forced, f"${LAYOUT_ENV}")
    stored = stored_layout(name, dtype)
    if stored is not None:
        return stored
    params = sum(m.weight.size for m in _laid_out_weights(model))
    if params < PROBE_MIN_PARAMS:
        return LayoutChoice(ROW, "mlx-lm's (a small model: not measured)")
    return save_layout(name, dtype, measure_layouts(model, LOAD_ROUNDS), LOAD_ROUNDS)


def apply_cpu_layout(model: nn.Module, name: str, dtype: str) -> LayoutChoice:
    choice = choose_layout(model, name, dtype)
    store_layout(model, choice.layout)
    return choice
