"""APAR (Liu et al. 2024): the model forks parallel threads at [Fork]; threads share the prefix KV.

Algorithm 1 on a `ForkableKVCache` (one slot pool; a thread is the list of slots on its path):

    prefill the prompt as thread 0 (the root)
    every step, every live thread feeds its pending token, all in ONE forward: the cache gives
        each token its own position (its depth on its path) and a mask row that sees exactly its
        path to the root, so each thread decodes as if it were alone
    a thread that samples [Fork] feeds it the next step like any token (its KV is written once,
        on the parent's path); right after that step a child is forked: it shares every slot of
        the parent's path (slot ids only, no K/V copied) and starts by feeding [Child]; the
        parent goes on with the next sibling paragraph
    a thread that samples EOS ends: its own slots are freed at once (shared ones stay while any
        live thread holds them)

Rules (as the reference): [Child] is never sampled (its logit is masked); no [Fork] right after a
control token (a thread that just fed [Fork] or [Child]); a thread at the depth limit or a step
that would pass the thread limit cannot fork either ([Fork] masked, so it writes inline).

Events: a child's `thread_start` (thread id, parent id) is emitted when its parent samples [Fork],
so it sits exactly where the child's text belongs in the parent's stream; `thread_end` when a
thread samples EOS. Control tokens and EOS are never emitted as tokens. The whole answer is the
tree restored by traversal: `mlx_specdec.apar.restore_answer(events, tokenizer)`.

Skeleton adapters (`mode: skeleton`, see `apar/adapter.py`): the LoRA update is gated per token,
on only for a thread that has forked (its [Fork] and what it writes after it); everything else is
the base model. Two rules change so that children write exactly the base model's text:

- the child is forked at once, sharing the parent's path up to the token that produced [Fork]
  (not the [Fork] itself), and starts with the token the model would have written there had
  [Fork] been masked: it simply goes on as the base model, with no [Child] fed;
- a child that has not forked itself ends at its first token containing a line break (the base
  model writes one where the detail ends; the parent's skeleton has the separator). That token is
  not written, as EOS is not.

Fork probe (full adapters shipped with `fork_probe.safetensors`, see `apar/probe.py`; option
`fork_probe`, on by default): until the root's first [Fork] the original model decodes (prompt
included) and a linear row on its hidden state gives the [Fork] logit; from that [Fork] on, the
adapted model decodes every thread. An answer that never forks is the original model's greedy
answer, token for token (so is every answer with `max_depth` 0 or `max_threads` 1: the adapted
model never runs); the step queued behind the first fork is dropped (it was the original
model's).

Sibling rule (`apar/siblings.py`; option `sibling_penalty`, default `DEFAULT_PENALTY`, 0 = off):
a parent sees only the heads it wrote, its children's details forked away, and a child sees none
of its siblings, so threads repeat each other's heads. A line that follows one of its thread's
heads (the lines it forked on) or, on a child's first line, an earlier sibling's first line, past
the head's first word, loses that much logit on the token that would continue it. A thread that
has not forked and has no earlier sibling is never touched: an unforked answer is unchanged.

One host sync per step: the sampled tokens (every fork/finish decision needs them). While the
host waits for them, the next step is already queued (`mx.async_eval`). Each step samples twice
per thread, with [Fork] allowed (where the depth limit allows) and with it masked; the step's
fork rules (thread limit, no [Fork] after a control token) are known before its tokens are read,
so the queued step is fed, in the graph, exactly what each thread writes. It stays right when a
thread forks (it feeds [Fork] next; the child joins the step after) or ends (its row is wasted,
its slot freed with it); it is dropped (`ForkableKVCache.undo_step`) and rebuilt only on a
skeleton adapter's fork and on the fork probe's first fork (the queued step ran on the original
model). Option `speculate=False` turns this off. The threads write the same
tokens either way up to float rounding: a queued step takes fresh slots where a step built after
a thread ended would reuse the freed ones, which reorders the attention sums (~1e-7 in float32).
The tests' models and the 40 list bench prompts gave the same tokens. When the last thread ends,
the step queued behind it is discarded uncounted, as `ar` does with its own. Dropped steps ran
a full forward: they count in `forward_passes` and are reported as `dropped_steps`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import mlx.core as mx

from ..apar.siblings import DEFAULT_PENALTY, SiblingRule
from ..apar.tokens import ControlTokens, control_tokens_for, newline_token_ids
from ..cache import ForkableKVCache
from ..errors import UserError
from ..host_traffic import Tally, queue, read_list, to_device
from ..model.forward import forward
from .base import DecodeContext, Step

DEFAULT_MAX_THREADS = 32
DEFAULT_MAX_DEPTH = 2


class NoControlTokens(UserError):
    pass


@dataclass
class _Thread:
    id: int
    parent: Optional[int]
    depth: int
    pending: int  # the token it feeds in the next step
    after_control: bool  # `pending` is [Fork] or [Child]: no [Fork] may follow it
    fork_child: Optional[int] = None  # pending is [Fork]: the child forked once it is written
    skeleton: bool = False  # has fed a [Fork] (skeleton adapters: LoRA on for its tokens)


def _cache_arrays(cache: ForkableKVCache) -> List[mx.array]:
    return [a for layer in cache.layers for a in (layer.keys, layer.values) if a is not None]


def prefill_thread(ctx: DecodeContext, cache: ForkableKVCache, thread: int, tokens, model=None) -> None:
    """Feed tokens to one thread of a forkable cache in chunks (no logits), with `model` (default:
    the context's)."""
    model = ctx.lm.model if model is None else model
    chunk = max(1, ctx.params.prefill_chunk)
    for start in range(0, len(tokens), chunk):
        piece = list(tokens[start : start + chunk])
        positions, mask = cache.begin_step([thread] * len(piece), allow_contiguous=True)
        forward(model, mx.array(piece)[None], cache, positions=positions, mask=mask, logits_for="none")
        mx.eval(_cache_arrays(cache))  # deliberate sync per chunk: bounds the graph and memory of prefill


def apar(ctx: DecodeContext) -> Iterator[Step]:
    control: Optional[ControlTokens] = ctx.resources.get("control_tokens") or control_tokens_for(ctx.lm)
    if control is None:
        raise NoControlTokens(
            f"apar needs a model with [Fork]/[Child] control tokens; {ctx.lm.name} has none: use an APAR "
            "adapter (models/apar-*, made by `mlx-specdec train-apar`) or an official THUDM/apar-* checkpoint")
    options = ctx.params.options
    max_threads = int(options.get("max_threads", DEFAULT_MAX_THREADS))
    max_depth = int(options.get("max_depth", DEFAULT_MAX_DEPTH))
    if max_threads < 1 or max_depth < 0:
        raise UserError("apar needs --max-threads >= 1 and --max-depth >= 0")
    processor = ctx.resources.get("logits_processor")  # (thread ids, logits (N, V)) -> logits
    model, stats, params = ctx.lm.model, ctx.stats, ctx.params
    greedy = params.greedy
    eos = ctx.lm.eos_token_ids
    cache: ForkableKVCache = ctx.resources.get("cache") or ForkableKVCache.for_model(model)
    gate = getattr(model, "lora_gate", None)  # set: a skeleton adapter (per-token LoRA)
    skeleton = gate is not None
    line_breaks = newline_token_ids(ctx.lm.tokenizer) if skeleton else frozenset()
    if skeleton:
        gate.value = None  # the prompt is the base model's, whatever ran before
        max_depth = min(max_depth, 1)  # the LoRA learned root skeletons only: children never fork
    # A fork probe (`apar/probe.py`): the original model writes the prompt's KV and the root until
    # its first [Fork], which one linear row reads off its hidden state; then the adapted model
    # decodes every thread. An answer that never forks is the original model's, token for token.
    probe = None if skeleton or not options.get("fork_probe", True) else getattr(model, "fork_probe", None)
    base_phase = probe is not None
    # Lines pushed off the heads threads have written already (`apar/siblings.py`); 0: off.
    penalty = float(options.get("sibling_penalty", DEFAULT_PENALTY))
    rule = SiblingRule(ctx.lm.tokenizer, penalty) if penalty > 0.0 else None
    step_no = 0  # the step whose tokens are being read; the next one built is step_no + 1

    prompt = ctx.prompt
    cache.new_thread(0)
    prefill_thread(ctx, cache, 0, prompt[:-1], model=probe.model if base_phase else model)
    ctx.prefill_done_at = time.perf_counter()
    threads: Dict[int, _Thread] = {0: _Thread(0, None, 0, prompt[-1], False)}
    if rule is not None:
        rule.start(0, None)
    next_id = 1
    figures = {"steps": 0, "rows": 0, "attended": 0, "max_cached": cache.live_slots, "max_live": 1,
               "answer_tokens": 0, "control_tokens": 0, "dropped": 0,
               "empty_children": 0, "base_tokens": 0}

    traffic = Tally()  # this answer's reads, host-built arrays and step shapes

    def report() -> None:
        P, T = len(prompt), figures["answer_tokens"]
        threads_written = next_id - figures["empty_children"]  # an empty child wrote nothing: not a thread
        stats.extra.update(
            threads=threads_written,
            forked=threads_written > 1,
            max_live_threads=figures["max_live"],
            decode_steps=figures["steps"],
            max_cached_tokens=figures["max_cached"],
            attended_tokens_mean=round(figures["attended"] / max(figures["rows"], 1), 2),
            answer_tokens=T,
            control_tokens=figures["control_tokens"],
            dropped_steps=figures["dropped"],
            fork_probe=probe is not None,
            base_model_tokens=figures["base_tokens"],  # written by the original model (fork probe)
            **traffic.figures(),
            # the same answer flattened and decoded sequentially after the P prompt tokens: one
            # step per fed token (the prompt's last, then every answer token but the last unless
            # it was followed by EOS), the n-th step seeing P + n - 1 cached tokens
            **flat_figures(P, T, ended=not threads),
        )

    def pick(logits: mx.array) -> mx.array:
        if greedy:
            chosen = mx.argmax(logits, axis=-1)
        else:
            chosen = ctx.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        return chosen.astype(mx.int32)  # argmax gives uint32; the next step feeds these as ids

    def build_step(order: List[int], tokens: mx.array, lora_on: List[bool], step: int) -> mx.array:
        """The lazy graph of one step: every thread in `order` feeds its token. Returns (2, N)
        sampled tokens: row 0 with [Fork] allowed wherever the depth limit allows it, row 1 with
        [Fork] masked (what the thread writes if it may not fork; where a skeleton adapter's child
        starts). The host picks per thread by the step's fork rules (`_fork_allowed`), which it
        knows before it reads the tokens. `step`: the step's number (the sibling rule's clock).
        Allocates each row's slot in the cache now."""
        positions, mask = cache.begin_step(order, allow_contiguous=True)
        if skeleton:  # LoRA only for rows of threads that have forked; none: the plain base forward
            gate.value = to_device(lora_on, dtype=mx.float32)[None, :, None] if any(lora_on) else None
        if base_phase:  # the original model and the probe's [Fork] logit (only the root is live)
            out = forward(probe.model, tokens[None], cache, positions=positions, mask=mask, logits_for="all")
            logits = probe.logits_with_control(out.hidden[0], out.logits[0])  # (N, V + 2)
        else:
            logits = forward(model, tokens[None], cache, positions=positions, mask=mask, logits_for="all").logits[0]
        if processor is not None:
            logits = processor(order, logits)  # (N, V)
        if rule is not None:
            logits = rule.apply(logits, tokens, order, step)
        may_fork = _apply_rules(logits, control, [threads[t].depth < max_depth for t in order])
        return mx.stack([pick(may_fork), pick(_apply_rules(logits, control, [False] * len(order)))])

    # Speculating the next step (pipelining, as `ar` does): while the host waits for this step's
    # tokens, the next step is already queued, every thread feeding what it writes now (row 0 or
    # row 1 by this step's fork rules, chosen in the graph). That is the right next step for every
    # thread that goes on, a forking one included (it feeds [Fork] next; its child joins the step
    # after). A thread that ends wasted one row of it, its slot freed with the thread. Two
    # exceptions drop the queued step (`undo_step`) and rebuild it: a skeleton adapter's fork (it
    # starts the child at once and turns the parent's LoRA on) and the fork probe's first fork
    # (the queued step ran on the original model; the adapted model feeds the [Fork]). A stateful logits processor (the
    # tests' script) would see a dropped step: no speculation then.
    speculate = bool(options.get("speculate", True)) and processor is None
    queued = None  # (order, chosen) of a step built before the previous step's tokens were read
    try:
        while threads:
            if queued is not None:
                order, chosen = queued  # may hold rows of threads that have ended since
            else:
                order = list(threads)  # live thread ids; row r of this step is thread order[r]
                tokens = to_device([threads[t].pending for t in order])
                chosen = build_step(order, tokens, [threads[t].skeleton for t in order], step_no + 1)
            queued = None
            step_no += 1
            rows = [r for r, t in enumerate(order) if t in threads]  # the rows of live threads
            live = [order[r] for r in rows]
            allowed = _fork_allowed(threads, live, max_threads, max_depth)  # this step's rules

            # The answer's figures count live rows (a row of an ended thread computed nothing read).
            figures["steps"] += 1
            traffic.verify((len(order),))
            figures["rows"] += len(live)
            figures["attended"] += sum(cache.length(t) for t in live)  # each row sees its whole path
            figures["max_cached"] = max(figures["max_cached"], cache.live_slots)
            figures["max_live"] = max(figures["max_live"], len(live))

            if speculate and not any(threads[t].fork_child is not None for t in live):
                live_rows = chosen[:, to_device(rows)] if len(rows) < len(order) else chosen
                written = mx.where(to_device(allowed), live_rows[0], live_rows[1])  # what each writes
                if base_phase:  # the original model has no [Fork] row: a fork drops this step anyway
                    written = mx.where(written == control.fork, live_rows[1], written)
                queued = (live, build_step(live, written, [threads[t].skeleton for t in live], step_no + 1))
                queue(queued[1])
            may_fork, no_fork = read_list(chosen)  # host sync (one per step), overlapped with the queued step
            values = [may_fork[r] if ok else no_fork[r] for r, ok in zip(rows, allowed)]
            child_starts = [no_fork[r] for r in rows]
            ends = [v in eos or (skeleton and threads[t].depth > 0 and not threads[t].skeleton and v in line_breaks)
                    for t, v in zip(live, values)]
            stats.forward_passes += 1
            if queued is not None and (skeleton or base_phase) and control.fork in values:
                # A skeleton fork changes the next step's rows; the probe's first fork hands over to
                # the adapted model, which feeds the [Fork]: drop the queued step.
                cache.undo_step(live)
                queued = None
                stats.forward_passes += 1  # it ran all the same
                figures["dropped"] += 1
            if base_phase:
                figures["base_tokens"] += sum(v != control.fork and not e for v, e in zip(values, ends))
                base_phase = control.fork not in values
            order = live

            # [Fork]s fed in this step are in the cache now: their children share the parent's path.
            for t in order:
                parent = threads[t]
                if parent.fork_child is not None:
                    child = parent.fork_child
                    cache.fork(t, child)
                    threads[child] = _Thread(child, t, parent.depth + 1, control.child, True)
                    parent.fork_child = None
            for row, (t, value) in enumerate(zip(order, values)):
                thread = threads[t]
                if ends[row]:
                    cache.free_thread(t)  # its own KV is released at once
                    del threads[t]
                    yield Step([], t, thread.parent, kind="thread_end")
                elif value == control.fork and skeleton:
                    # The child shares the path as it is now and goes on as the base model would.
                    child, start = next_id, child_starts[row]
                    next_id += 1
                    thread.pending, thread.after_control, thread.skeleton = value, True, True
                    figures["control_tokens"] += 1  # the parent's [Fork]
                    if rule is not None:
                        rule.forked(t, step_no)
                        rule.start(child, t)
                    yield Step([], child, t, kind="thread_start")
                    if start in eos or start in line_breaks:  # the base would end here: an empty child
                        figures["empty_children"] += 1
                        yield Step([], child, t, kind="thread_end")
                        continue
                    cache.fork(t, child)
                    threads[child] = _Thread(child, t, thread.depth + 1, start, False)
                    if rule is not None:  # its first token was sampled in the parent's row
                        rule.wrote(child, start, step_no)
                    figures["answer_tokens"] += 1  # the child's first token
                    yield Step([start], child, t)
                elif value == control.fork:
                    thread.pending, thread.after_control, thread.fork_child = value, True, next_id
                    figures["control_tokens"] += 2  # the parent's [Fork] and the child's [Child]
                    next_id += 1
                    if rule is not None:
                        rule.forked(t, step_no)
                        rule.start(thread.fork_child, t)
                    yield Step([], thread.fork_child, t, kind="thread_start")
                else:
                    thread.pending, thread.after_control = value, False
                    figures["answer_tokens"] += 1
                    if rule is not None:
                        rule.wrote(t, value, step_no)
                    yield Step([value], t, thread.parent)
            report()
    finally:
        report()
        if skeleton:
            gate.value = None  # the model is the base model again for whoever runs it next
        for t in list(cache.paths):  # the stream may stop mid-answer: release every thread
            cache.free_thread(t)
        if queued is not None:
            mx.eval(queued[1])  # settle the queued step, so it does not run into whatever is next


def flat_figures(prompt_tokens: int, answer_tokens: int, ended: bool) -> Dict[str, float]:
    """What plain decoding of the flattened answer costs: steps, peak cache, mean attended."""
    steps = answer_tokens + (1 if ended else 0)  # ended: the step after the last token wrote EOS
    return {"flat_decode_steps": steps, "flat_max_cached_tokens": prompt_tokens + steps - 1,
            "flat_attended_tokens_mean": round(prompt_tokens + (steps - 1) / 2, 2)}


def _fork_allowed(threads: Dict[int, _Thread], order: List[int], max_threads: int, max_depth: int) -> List[bool]:
    """Per row: may this thread fork now? Threads, announced children included, stay within the limit."""
    live = len(threads) + sum(1 for t in threads.values() if t.fork_child is not None)
    budget = max_threads - live
    allowed = []
    for t in order:
        thread = threads[t]
        ok = budget > 0 and not thread.after_control and thread.depth < max_depth
        budget -= ok
        allowed.append(ok)
    return allowed


def _apply_rules(logits: mx.array, control: ControlTokens, fork_allowed: List[bool]) -> mx.array:
    """Mask [Child] everywhere and [Fork] where a thread may not fork. logits (N, V)."""
    logits = logits.astype(mx.float32)
    blocked = mx.array(-float("inf"), dtype=logits.dtype)
    logits[:, control.child] = blocked
    if not all(fork_allowed):
        logits[:, control.fork] = mx.where(to_device(fork_allowed), logits[:, control.fork], blocked)
    return logits
