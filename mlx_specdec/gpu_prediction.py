"""A PREDICTION, not a measurement: each method's speed-up over plain decoding for a Vicuna-shaped
model on Apple GPUs, from a bandwidth model and the acceptance measured on the default model.

    plain step      t(1, C)
    T-token verify  t(T, C) = max(bytes(C) / (BW * 0.75), flops(T, C) / (FLOPS * 0.5))
                    bytes(C) = every weight (4-bit: 4.5 bits a parameter with its scales and biases)
                               + the float16 KV of C tokens (2 * layers * hidden * 2 bytes a token)
                    flops(T, C) = 2 * params * T + 4 * layers * hidden * C * T
    4-bit, few rows optionally: the weights' bytes times the cost of an m-row 4-bit matmul over a
                    one-row one (1.2 / 1.4 / 2.05 at m = 2 / 4 / 7, an upstream measurement on an M4 Pro
                    cited in docs/benchmarking.md; linear between, the last slope beyond 7)
    ReDrafter       (1 + a_1 + ... + a_d) t(1, C) / (t(d + 1, C) + d * head bytes / (BW * 0.75)),
                    a_i: the default model's acceptance at draft depth i, the head read once a depth
                    in float32 (load_drafter loads every head so), d = 5 by default
    APAR            s t(1, C) / t(s, C), s: the default model's tokens per decoding step
    TriForce        E t(1, C) / (g t_mid + t(g + 1, C)), g = 6 middle forwards a round (no bottom
                    level), t_mid = t(1) over B + g cached keys, E = (1 - a^(g+1)) / (1 - a)
                    for a middle-level acceptance a

Left out: per-step fixed latency (kernel launches, the host's step work): the engine overlaps the
host with the device, and what is left costs each speculative method in proportion to its steps.
`python -m mlx_specdec.gpu_prediction [vicuna-7b]` prints the table in docs/benchmarking.md.
"""

from __future__ import annotations

import sys
from typing import Dict, List, NamedTuple, Optional

from .synthetic_shapes import QUANT_BITS_PER_PARAM, Shape, head_params, preset


class Gpu(NamedTuple):
    bandwidth: float  # bytes/s
    flops: float  # float16 FLOP/s


GPUS = {"M2 Pro": Gpu(200e9, 6.8e12), "M3 Max": Gpu(400e9, 14.2e12)}
BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY = 0.75, 0.5
FEW_ROW_4BIT = ((1, 1.0), (2, 1.2), (4, 1.4), (7, 2.05))
PRECISIONS = {"4-bit": QUANT_BITS_PER_PARAM, "f16": 16.0}

# the default model's figures (benchmarks/results/README.md)
REDRAFTER_ACCEPTANCE = (0.588, 0.23, 0.102, 0.054, 0.018)  # the shipped head's, unseen chats: 2.0 tokens a forward (docs/benchmarking.md)
APAR_TOKENS_PER_STEP = 1.579  # cpu_layout_apar_list8.md (8 list prompts, 5.1 threads when forked)
TRIFORCE_ACCEPTANCE = {"measured 2K/4K": 0.65, "quoting 6K": 0.80}  # measured and quoted figures (docs/benchmarking.md)
TRIFORCE_GAMMA = 6
CHAT_CONTEXT = 2048


def row_factor(rows: float) -> float:
    points = FEW_ROW_4BIT
    for (m0, f0), (m1, f1) in zip(points, points[1:]):
        if rows <= m1:
            return f0 + (f1 - f0) * (max(rows, m0) - m0) / (m1 - m0)
    (m0, f0), (m1, f1) = points[-2:]
    return f1 + (f1 - f0) / (m1 - m0) * (rows - m1)


def step_ms(shape: Shape, bits: float, gpu: Gpu, rows: float, context: int, keys: Optional[int] = None,
            few_row: bool = False) -> float:
    """A forward of `rows` query tokens over `keys` cached keys (default: the context)."""
    weights = shape.weight_bytes(bits=bits) * (row_factor(rows) if few_row and bits < 16 else 1.0)
    keys = context if keys is None else keys
    memory = (weights + shape.kv_bytes(keys)) / (gpu.bandwidth * BANDWIDTH_EFFICIENCY)
    compute = (2 * shape.params() * rows + 4 * shape.layers * shape.hidden * keys * rows) / (gpu.flops * COMPUTE_EFFICIENCY)
    return 1000 * max(memory, compute)


def head_depth_ms(shape: Shape, gpu: Gpu, output: str, draft_vocab: int, item_bytes: int = 4) -> float:
    size = head_params(shape.hidden, shape.vocab, output, draft_vocab) * item_bytes
    return 1000 * size / (gpu.bandwidth * BANDWIDTH_EFFICIENCY)


def redrafter(shape, bits, gpu, depth, output, vocab, few_row=False, item_bytes=4, context=CHAT_CONTEXT) -> float:
    tokens = 1 + sum(REDRAFTER_ACCEPTANCE[:depth])
    step = step_ms(shape, bits, gpu, depth + 1, context, few_row=few_row) + depth * head_depth_ms(
        shape, gpu, output, vocab, item_bytes)
    return tokens * step_ms(shape, bits, gpu, 1, context, few_row=few_row) / step


def best_depth(shape, bits, gpu, output, vocab, few_row=False, item_bytes=4) -> tuple:
    speeds = [(redrafter(shape, bits, gpu, d, output, vocab, few_row, item_bytes), d)
              for d in range(1, len(REDRAFTER_ACCEPTANCE) + 1)]
    return max(speeds)


def apar(shape, bits, gpu, few_row=False, context=CHAT_CONTEXT) -> float:
    s = APAR_TOKENS_PER_STEP
    return s * step_ms(shape, bits, gpu, 1, context, few_row=few_row) / step_ms(shape, bits, gpu, s, context,
                                                                               few_row=few_row)


def triforce(shape, bits, gpu, context, budget, acceptance, few_row=False, gamma=TRIFORCE_GAMMA) -> float:
    tokens = (1 - acceptance ** (gamma + 1)) / (1 - acceptance)
    middle = step_ms(shape, bits, gpu, 1, context, keys=budget + gamma, few_row=few_row)
    round_ms = gamma * middle + step_ms(shape, bits, gpu, gamma + 1, context, few_row=few_row)
    return tokens * step_ms(shape, bits, gpu, 1, context, few_row=few_row) / round_ms


def predict(shape: Shape) -> List[dict]:
    """One row per method and setting: {"method", "setting", "cells": {"M2 Pro 4-bit": text, ...}}."""
    K = min(8192, shape.vocab)
    heads = {"full-vocabulary head": ("draft_vocab", shape.vocab), f"llm_head K={K}": ("llm_head", K)}
    rows = []

    def add(method: str, setting: str, value, few: bool = True) -> None:
        cells = {}
        for gpu_name, gpu in GPUS.items():
            for precision, bits in PRECISIONS.items():
                main = value(bits, gpu, False)
                text = _fmt(main)
                if bits < 16 and few:
                    text += f" ({_fmt(value(bits, gpu, True))})"
                cells[f"{gpu_name} {precision}"] = text
        rows.append({"method": method, "setting": setting, "cells": cells})

    add("plain step", f"{CHAT_CONTEXT} ctx, ms", lambda b, g, f: ("ms", step_ms(shape, b, g, 1, CHAT_CONTEXT)), few=False)
    for label, (output, vocab) in heads.items():
        add("redrafter", f"{label}, f32, 5 drafts", lambda b, g, f, o=output, v=vocab: redrafter(shape, b, g, 5, o, v, f))
        add("redrafter", f"{label}, f32, best depth",
            lambda b, g, f, o=output, v=vocab: ("best", *best_depth(shape, b, g, o, v, f)))
    add("redrafter", f"llm_head K={K}, f16 head, best depth",
        lambda b, g, f: ("best", *best_depth(shape, b, g, "llm_head", K, f, item_bytes=2)))
    add("apar", f"{APAR_TOKENS_PER_STEP} tokens a step", lambda b, g, f: apar(shape, b, g, f))
    for context in (8192, 16384):
        for budget, (name, acceptance) in ((512, next(iter(TRIFORCE_ACCEPTANCE.items()))),
                                           *((b, item) for b in (512, 4096)
                                             for item in list(TRIFORCE_ACCEPTANCE.items())[1:])):
            add("triforce", f"{context // 1024}K ctx, B={budget}, a={acceptance} ({name})",
                lambda b, g, f, c=context, B=budget, a=acceptance: triforce(shape, b, g, c, B, a, f))
    return rows


def _fmt(value) -> str:
    if isinstance(value, tuple) and value[0] == "ms":
        return f"{value[1]:.3g} ms"
    if isinstance(value, tuple):  # ("best", speed-up, depth)
        return f"{value[1]:.2f}x d={value[2]}"
    return f"{value:.2f}x"


def markdown(rows: List[dict]) -> str:
    """The table; where every speed-up is the same on each GPU (all under the bandwidth bound), one
    column per precision, the plain step's milliseconds per GPU."""
    columns = list(rows[0]["cells"])
    precisions = list(PRECISIONS)
    same = all(len({row["cells"][f"{g} {p}"] for g in GPUS}) == 1 for row in rows[1:] for p in precisions)
    lines = []
    if same:
        first = next(iter(GPUS))
        lines += ["| method | setting | " + " | ".join(precisions) + " |", "|---|---|" + "---:|" * len(precisions)]
        for row in rows:
            if row["method"] == "plain step":
                cells = [" / ".join(row["cells"][f"{g} {p}"] for g in GPUS) for p in precisions]
                lines.append(f"| plain step ({' / '.join(GPUS)}) | {row['setting']} | " + " | ".join(cells) + " |")
            else:
                lines.append(f"| {row['method']} | {row['setting']} | "
                             + " | ".join(row["cells"][f"{first} {p}"] for p in precisions) + " |")
    else:
        lines += ["| method | setting | " + " | ".join(columns) + " |", "|---|---|" + "---:|" * len(columns)]
        lines += [f"| {row['method']} | {row['setting']} | " + " | ".join(row["cells"][c] for c in columns) + " |"
                  for row in rows]
    return "\n".join(lines) + "\n"


def inputs() -> Dict[str, object]:
    return {"gpus": {k: {"bandwidth_gb_s": g.bandwidth / 1e9, "tflops": g.flops / 1e12} for k, g in GPUS.items()},
            "bandwidth_efficiency": BANDWIDTH_EFFICIENCY, "compute_efficiency": COMPUTE_EFFICIENCY,
            "few_row_4bit": FEW_ROW_4BIT, "redrafter_acceptance": REDRAFTER_ACCEPTANCE,
            "apar_tokens_per_step": APAR_TOKENS_PER_STEP, "triforce_acceptance": TRIFORCE_ACCEPTANCE,
            "triforce_gamma": TRIFORCE_GAMMA, "chat_context": CHAT_CONTEXT}


if __name__ == "__main__":
    print(markdown(predict(preset(sys.argv[1] if len(sys.argv) > 1 else "vicuna-7b"))), end="")
