"""`mlx-specdec bench --synthetic NAME`: a Vicuna-shaped Llama with random weights, measured on this
machine with the engine's own forward (model/forward.py) and caches, no download and no prefill.

The model is mlx-lm's llama `Model` of the preset's exact shape (synthetic_shapes.py) in float16,
for a -4bit name quantized by `nn.quantize` (group 64, 4 bits); then treated as the engine's loader
treats a checkpoint here: computed in float32 on the CPU (the checkpoint's dtype on a GPU), a 4-bit
model dequantized where the loader's rule would for the FULL model's size (loader.should_dequantize:
float32 weights in 40 % of RAM). `--layers N` builds N blocks only; every forward time is then
    ends(T) + (measured(T) - ends(T)) * layers / N
where ends(T) is the embedding, final norm and vocabulary projection of T tokens, timed alone (and
APAR's host-side step work is added unscaled). The caches are filled with random keys and values
to the context, their buffers and offsets set directly (the forkable pool's paths too).

Measured at each context, every case once to warm up (at the first context that has it: the graphs
do not depend on the context), then `rounds` rounds each in its own rotated order (as
drafting/cost_probe.py), medians:
    (a) a T-token verify (model/timing.verify_forward: one row, every logit) for T = 1..16;
    (b) ReDrafter's head drafting a 5-deep greedy chain (redrafter_head/beam.compiled_chain, the
        whole chain in one graph as the device step drafts it) for two head shapes, and APAR's
        extra per forked step: the forkable pool's positions and path mask (cache/forkable.py);
    (c) a one-token forward through TriForce's retrieval cache (budgets 512 and 4096) at 8K+;
    (d) k = 1, 2, 4, 8 APAR threads decoding one token each in one forward over a shared prefix;
    (e) the peak memory of each context's measurements and of the run.
"""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .bench_prompts import REPO_ROOT
from .cache.contiguous import GROW_STEP, ContiguousKVCache
from .cache.forkable import ForkableKVCache
from .cache.retrieval import RetrievalKVCache
from .errors import UserError
from .model.device import machine, on_cpu
from .model.forward import forward, lm_head
from .model.timing import verify_forward
from .synthetic_shapes import QUANT_BITS, QUANT_GROUP, Shape, head_params, preset

MAX_TOKENS = 16  # (a): T = 1..16
THREADS = (1, 2, 4, 8)  # (d)
RETRIEVAL_MIN_CONTEXT = 8192  # (c): TriForce's regime
RETRIEVAL_BUDGETS = (512, 4096)
CHAIN_DEPTHS = 5  # ReDrafter's default beam length 6: the target's token and 5 drafts
HEAD_VOCAB = 8192  # the project's own head form: an 8192-token draft vocabulary scored by the LLM's rows
RAM_SHARE = 0.85  # refuse a build that would need more of the machine's RAM than this


def head_shapes(shape: Shape) -> Dict[str, dict]:
    """Two ReDrafter heads for the LLM's width: Apple's released form (the full vocabulary projected
    from the 2 * hidden wide blocks) and this project's shipped form (llm_head, K = 8192)."""
    return {"full vocabulary (Apple's form)": dict(output="draft_vocab", draft_vocab_size=shape.vocab),
            f"llm_head, K = {min(HEAD_VOCAB, shape.vocab)} (ours)": dict(output="llm_head",
                                                                        draft_vocab_size=min(HEAD_VOCAB, shape.vocab))}


# -- the model -------------------------------------------------------------------------------------

def compute_dtype(choice: str) -> str:
    if choice != "auto":
        return choice
    return "float32" if on_cpu() else "float16"


def dequantizes(shape: Shape, choice: str) -> bool:
    """The loader's rule (loader.should_dequantize) for the full model, not for the layers built."""
    from .model.loader import DEQUANTIZE_RAM_SHARE

    if not shape.bits or choice == "off":
        return False
    if choice == "on":
        return True
    return on_cpu() and shape.params() * 4 <= DEQUANTIZE_RAM_SHARE * _ram()


def _ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def build_model(shape: Shape, layers: int, dtype: str, dequantize: bool, max_positions: int) -> nn.Module:
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", hidden_size=shape.hidden, num_hidden_layers=layers,
                     intermediate_size=shape.ffn, num_attention_heads=shape.heads,
                     num_key_value_heads=shape.kv_heads, rms_norm_eps=1e-5, vocab_size=shape.vocab,
                     max_position_embeddings=max_positions, rope_theta=10000.0, tie_word_embeddings=False)
    mx.random.seed(0)
    model = Model(args)
    model.set_dtype(mx.float16)  # the checkpoint
    mx.eval(model.parameters())
    if shape.bits:
        nn.quantize(model, group_size=QUANT_GROUP, bits=QUANT_BITS)
        mx.eval(model.parameters())
        if dequantize:
            from mlx_lm.utils import dequantize_model

            model = dequantize_model(model)
    model.set_dtype(getattr(mx, dtype))  # a kept 4-bit model: its scales and biases only
    mx.eval(model.parameters())
    return model


def cpu_layout(model: nn.Module, dtype: str) -> str:
    """$MLX_SPECDEC_CPU_LAYOUT where set, else mlx-lm's row-major (a random model is not probed)."""
    from .model.cpu_layout import LAYOUT_ENV, ROW, store_layout

    if not (on_cpu() and dtype == "float32"):
        return "mlx-lm's"
    forced = os.environ.get(LAYOUT_ENV, "").strip().lower()
    layout = forced if forced in ("row", "column") else ROW
    store_layout(model, layout)
    return f"{layout}-major" + (f" (${LAYOUT_ENV})" if forced else " (mlx-lm's; not probed)")


def random_head(model: nn.Module, shape: Shape, form: dict):
    from .model.cpu_layout import COLUMN, current_layout, store_layout
    from .redrafter_head.model import DrafterConfig, DrafterHead, llm_output_rows

    config = DrafterConfig(llm_hidden_size=shape.hidden, embed_size=shape.hidden, vocab_size=shape.vocab,
                           draft_length=CHAIN_DEPTHS, **form)
    K = config.draft_vocab_size
    head = DrafterHead(config, None if K == shape.vocab else mx.arange(K))
    if config.output == "llm_head":
        head.attach_output_rows(llm_output_rows(SimpleNamespace(model=model), mx.arange(K)))
    head.set_dtype(mx.float32)  # as load_drafter loads every head
    mx.eval(head.parameters(), head._output_rows if config.output == "llm_head" else [])
    if on_cpu() and current_layout(model) == COLUMN:
        store_layout(head, COLUMN)
    return head


# -- caches filled to a context ---------------------------------------------------------------------

def _random_kv(shape: Shape, capacity: int, dtype) -> mx.array:
    array = (0.5 * mx.random.normal((1, shape.kv_heads, capacity, shape.head_dim))).astype(dtype)
    mx.eval(array)
    return array


def filled_contiguous(model, shape: Shape, context: int, spare: int, dtype) -> ContiguousKVCache:
    cache = ContiguousKVCache.for_model(model)
    capacity = -(-(context + spare) // GROW_STEP) * GROW_STEP  # room for the longest verify: no growth
    for layer in cache.layers:
        layer.keys, layer.values = _random_kv(shape, capacity, dtype), _random_kv(shape, capacity, dtype)
        layer.offset = context
    return cache


def filled_pool(model, shape: Shape, context: int, threads: int, dtype) -> ForkableKVCache:
    """A forkable pool whose thread 0 holds `context` slots and threads 1.. are forked from it."""
    cache = ForkableKVCache.for_model(model)
    cache.capacity = -(-(context + threads) // GROW_STEP) * GROW_STEP
    for layer in cache.layers:
        layer.keys, layer.values = _random_kv(shape, cache.capacity, dtype), _random_kv(shape, cache.capacity, dtype)
    cache.paths = {0: list(range(context))}
    cache.refcount = [1] * context
    cache.high_water = context
    for thread in range(1, threads):
        cache.fork(0, thread)
    return cache


def _reset_pool(cache: ForkableKVCache, context: int) -> None:
    """After `undo_step`: the pool exactly as `filled_pool` left it (no free slots past the prefix)."""
    cache.free_slots.clear()
    del cache.refcount[context:]
    cache.high_water = context


# -- the cases timed ---------------------------------------------------------------------------------

def rotated_medians(cases: Dict[str, Callable[[], None]], rounds: int, warmed: Optional[set] = None) -> Dict[str, float]:
    """Each case not in `warmed` once (its kernels and compiled graphs built; added to `warmed`: a
    case of the same name at another context reuses them), then `rounds` rounds, round r starting
    at case r: a slow spell of the machine touches every case alike. -> median ms per case."""
    names = list(cases)
    warmed = set() if warmed is None else warmed
    for name in names:
        if name not in warmed:
            cases[name]()
            warmed.add(name)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            start = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * float(np.median(t)) for name, t in times.items()}


def _ends(model, tokens: int) -> Callable[[], None]:
    inner = model.model
    ids = mx.array([[5 + i for i in range(tokens)]])
    return lambda: mx.eval(lm_head(model, inner.norm(inner.embed_tokens(ids))))


def _chain(head, embed, hidden: mx.array) -> Callable[[], None]:
    from .redrafter_head.beam import compiled_chain

    first, _, deeper = compiled_chain(head, embed)
    token = mx.array([5])

    def draft():
        state, draft, score, confidence = first(hidden, token)
        outputs = [draft, confidence]
        for _ in range(CHAIN_DEPTHS - 1):
            state, draft, score, confidence = deeper(state, hidden, draft, score)
            outputs += [draft, confidence]
        mx.eval(outputs)
    return draft


def _pool_step(model, cache: ForkableKVCache, context: int, threads: int, with_forward: bool):
    ids = list(range(threads))
    tokens = mx.array([[7 + i for i in ids]])

    def step():
        positions, mask = cache.begin_step(ids, allow_contiguous=True)
        if with_forward:
            mx.eval(forward(model, tokens, cache, positions=positions, mask=mask, logits_for="all").logits)
        else:  # the host's part alone: slots, positions, the path mask
            mx.eval(positions, mask)
        cache.undo_step(ids)
        _reset_pool(cache, context)
    return step


def _retrieval_step(model, cache: RetrievalKVCache):
    token = mx.array([[9]])

    def step():
        mx.eval(forward(model, token, cache, logits_for="all").logits)
        cache.trim(1)
    return step


# -- the run -----------------------------------------------------------------------------------------

def check_fits(shape: Shape, layers: int, dtype: str, dequantize: bool, contexts: List[int]) -> None:
    """Refuse, in one line, a build this machine's RAM cannot hold (weights, the float16 checkpoint
    they are made from, both heads in float32, the contiguous cache and the pool at the longest context)."""
    item = 4 if dtype == "float32" else 2
    weights = shape.params(layers) * (item if dequantize or not shape.bits else 4.5 / 8)
    heads = sum(head_params(shape.hidden, shape.vocab, form["output"], form["draft_vocab_size"])
                for form in head_shapes(shape).values()) * 4
    caches = 2 * shape.kv_bytes(max(contexts) + 2 * GROW_STEP, layers, item)
    need, ram = weights + 2 * shape.params(layers) + heads + caches, _ram()
    if need > RAM_SHARE * ram:
        raise UserError(f"{layers} layers of this shape at {max(contexts)} tokens need about {need / 2**30:.0f} GB, "
                        f"this machine has {ram / 2**30:.0f} GB: build fewer with --layers N "
                        "(costs are scaled to the full depth)")


def run_synthetic(name: str, layers: Optional[int] = None, rounds: int = 3, contexts=(256, 2048, 8192, 16384),
                  dtype_choice: str = "auto", dequantize_choice: str = "auto", progress=None) -> dict:
    shape = preset(name)
    built = shape.layers if layers is None else layers
    if not 1 <= built <= shape.layers:
        raise UserError(f"--layers is 1 to {shape.layers} for {name}, not {built}")
    if rounds < 1:
        raise UserError(f"--rounds is at least 1, not {rounds}")
    contexts = sorted(set(int(c) for c in contexts))
    if not contexts or contexts[0] < 1:
        raise UserError("--contexts takes positive token counts")
    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    dtype = compute_dtype(dtype_choice)
    dequantize = dequantizes(shape, dequantize_choice)
    check_fits(shape, built, dtype, dequantize, contexts)
    max_positions = max(shape.max_positions, contexts[-1] + 2 * MAX_TOKENS)
    mx.reset_peak_memory()
    say(f"building {name}: {built} of {shape.layers} layers, {dtype} ...")
    model = build_model(shape, built, dtype, dequantize, max_positions)
    layout = cpu_layout(model, dtype)
    build_peak = mx.get_peak_memory()
    scale = shape.layers / built

    def scaled(ms: float, ends: float, host: float = 0.0) -> float:
        return host + ends + max(0.0, ms - host - ends) * scale

    heads = {label: random_head(model, shape, form) for label, form in head_shapes(shape).items()}
    hidden = mx.random.normal((1, shape.hidden)).astype(getattr(mx, dtype))
    ends_tokens = sorted(set(range(1, MAX_TOKENS + 1)) | set(THREADS))
    say(f"the vocabulary ends and the draft heads: {len(ends_tokens) + len(heads)} cases x {rounds} rounds ...")
    fixed = rotated_medians({**{f"ends {t}": _ends(model, t) for t in ends_tokens},
                             **{label: _chain(head, model.model.embed_tokens, hidden) for label, head in heads.items()}},
                            rounds)
    ends = {t: fixed[f"ends {t}"] for t in ends_tokens}
    verify, overheads, retrieval, threads, memory, warmed = [], [], [], [], [], set()
    for context in contexts:
        mx.reset_peak_memory()
        cache = filled_contiguous(model, shape, context, MAX_TOKENS, getattr(mx, dtype))
        pool = filled_pool(model, shape, context, max(THREADS), getattr(mx, dtype))
        cases = {f"T {t}": (lambda t=t, c=cache: verify_forward(model, c, t)) for t in range(1, MAX_TOKENS + 1)}
        for k in THREADS:
            cases[f"pool {k}"] = _pool_step(model, pool, context, k, True)
            cases[f"host {k}"] = _pool_step(model, pool, context, k, False)
        budgets = [b for b in RETRIEVAL_BUDGETS if b < context] if context >= RETRIEVAL_MIN_CONTEXT else []
        for budget in budgets:
            queries = [mx.random.normal((1, shape.heads, 1, shape.head_dim)).astype(getattr(mx, dtype))
                       for _ in model.model.layers]
            cases[f"retrieval {budget}"] = _retrieval_step(model, RetrievalKVCache.build(cache, queries, budget))
        say(f"context {context}: {len(cases)} cases x {rounds} rounds ...")
        ms = rotated_medians(cases, rounds, warmed)
        one = scaled(ms["T 1"], ends[1])
        for t in range(1, MAX_TOKENS + 1):
            value = scaled(ms[f"T {t}"], ends[t])
            verify.append({"context": context, "tokens": t, "ms": round(value, 2), "ratio": round(value / one, 3),
                           "measured_ms": round(ms[f"T {t}"], 2)})
        for label in heads:
            overheads.append({"context": context, "what": f"redrafter head, {CHAIN_DEPTHS}-deep chain: {label}",
                              "ms": round(fixed[label], 2), "host_ms": None,
                              "x_one_token_forward": round(fixed[label] / one, 3)})
        lone = scaled(ms["pool 1"], ends[1], ms["host 1"])
        overheads.append({"context": context, "what": "apar, a forked step's positions and path mask (1 thread)",
                          "ms": round(lone - one, 2), "host_ms": round(ms["host 1"], 2),
                          "x_one_token_forward": round((lone - one) / one, 3)})
        for k in THREADS:
            value = scaled(ms[f"pool {k}"], ends[k], ms[f"host {k}"])
            threads.append({"context": context, "threads": k, "ms": round(value, 2), "measured_ms": round(ms[f"pool {k}"], 2),
                            "host_ms": round(ms[f"host {k}"], 2),
                            "x_one_thread": round(value / lone, 3), "x_plain_step": round(value / one, 3)})
        for budget in budgets:
            value = scaled(ms[f"retrieval {budget}"], ends[1])
            retrieval.append({"context": context, "budget": budget, "ms": round(value, 2),
                              "measured_ms": round(ms[f"retrieval {budget}"], 2), "full_ms": round(one, 2),
                              "x_full": round(value / one, 3)})
        memory.append({"context": context, "peak_mb": round(mx.get_peak_memory() / 2**20, 1),
                       "kv_mb_built": round(2 * _buffer_bytes(cache) / 2**20, 1)})
        del cache, pool, cases
        gc.collect()
        mx.clear_cache()
    model_record = {"name": name, "layers": shape.layers, "layers_built": built, "hidden": shape.hidden,
                    "ffn": shape.ffn, "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab,
                    "params": shape.params(), "checkpoint": "4-bit, group 64" if shape.bits else "float16",
                    "compute_dtype": dtype, "weights_on_this_machine": _weights_note(shape, dequantize, dtype),
                    "weight_layout": layout, "max_positions": max_positions,
                    "weights_mb_built": round(sum(v.nbytes for _, v in _flat(model)) / 2**20, 1),
                    "scaling": (f"{built} of {shape.layers} layers built; every forward time is ends(T) + "
                                f"(measured - ends(T)) x {shape.layers}/{built}, ends = embedding, final norm and "
                                "vocabulary projection timed alone; APAR's host work is added unscaled"
                                if built < shape.layers else "every layer built: nothing scaled")}
    return {"environment": environment(), "model": model_record,
            "params": {"rounds": rounds, "contexts": contexts, "max_tokens": MAX_TOKENS, "threads": list(THREADS),
                       "retrieval_budgets": list(RETRIEVAL_BUDGETS), "chain_depths": CHAIN_DEPTHS},
            "ends_ms": {str(t): round(v, 2) for t, v in ends.items()}, "verify_cost": verify,
            "overheads": overheads, "retrieval": retrieval, "threads": threads,
            "memory": {"per_context": memory, "peak_mb_build": round(build_peak / 2**20, 1),
                       "peak_mb_run": round(max([build_peak / 2**20] + [m["peak_mb"] for m in memory]), 1)}}


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def _buffer_bytes(cache: ContiguousKVCache) -> int:
    return sum(layer.keys.nbytes for layer in cache.layers)


def _weights_note(shape: Shape, dequantize: bool, dtype: str) -> str:
    if not shape.bits:
        return f"float16 checkpoint computed in {dtype}" + (" (the engine's CPU dtype)" if on_cpu() else "")
    if dequantize:
        return f"4-bit, dequantized to {dtype} as the loader does here (its float32 weights fit 40 % of RAM)"
    why = "the full model's float32 weights would not fit 40 % of RAM" if on_cpu() else "a GPU keeps it quantized"
    return f"4-bit kept quantized ({why}), activations, scales and biases in {dtype}"


def environment() -> dict:
    import mlx_lm

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__, "machine": machine(), "python": platform.python_version(),
            "ram_gb": round(_ram() / 2**30, 1), "git_commit": commit or "unknown"}
