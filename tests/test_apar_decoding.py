"""APAR decoding on a tiny random Llama with a scripted fork pattern.

A test double (`Script`, passed as the strategy's logits processor) forces [Fork] / EOS at chosen
samplings of chosen threads by editing logits, suppresses them everywhere else, and records every
thread's raw logits and the cache at every step. So each test knows the tree it asked for and can
check the strategy against plain decoding of every thread's root path.
"""

from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.apar import control_tokens_for, restore_answer, restore_tokens, tree_from_events
from mlx_specdec.cache import ContiguousKVCache, ForkableKVCache
from mlx_specdec.decoding import GenerationParams, stream_events
from mlx_specdec.decoding.apar import NoControlTokens, apar
from mlx_specdec.engine import Engine
from mlx_specdec.model.forward import forward
from mlx_specdec.model.loader import LoadedModel

from conftest import make_tiny_llama, make_tiny_lm

FORK, CHILD, EOS = 95, 96, 2
PROMPT = [5, 17, 42, 3, 88, 11]


def make_apar_tokenizer(vocab_size: int = 97):
    """Word-level tokenizer: ids 0..94 are "w{i}", 95 is [Fork], 96 is [Child]; EOS w2."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab.update({"[Fork]": FORK, "[Child]": CHILD})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{EOS}", unk_token="w0")
    return TokenizerWrapper(fast)


def make_apar_lm(seed: int = 0) -> LoadedModel:
    model = make_tiny_llama(seed=seed, layers=2, tie=False)
    config = {"model_type": "llama", "max_position_embeddings": 512, "vocab_size": 97}
    return LoadedModel(model, make_apar_tokenizer(), Path("."), "tiny-apar", config, "float32", None)


class Script:
    """Logits processor: plan {(thread, k): token} forces `token` at the k-th sampling of
    `thread`; [Fork] and EOS are suppressed everywhere else. Records raw logits and the cache."""

    def __init__(self, plan, cache=None):
        self.plan = dict(plan)
        self.calls = defaultdict(int)
        self.logits = defaultdict(list)  # thread -> raw logits rows, one per token it fed
        self.steps = []  # per step: (thread order, live_slots, high_water, paths, free slots)
        self.cache = cache
        self.orders = []  # thread order (rows) of every step

    def __call__(self, order, logits):
        raw = np.array(logits)  # a sync inside the step: fine for a test double
        self.orders.append(list(order))
        if self.cache is not None:
            c = self.cache
            self.steps.append((list(order), c.live_slots, c.high_water,
                               {t: list(p) for t, p in c.paths.items()}, list(c.free_slots)))
        bias = np.zeros_like(raw)
        bias[:, [FORK, EOS]] = -1e4
        for row, thread in enumerate(order):
            k = self.calls[thread]
            self.calls[thread] += 1
            self.logits[thread].append(raw[row])
            want = self.plan.get((thread, k))
            if want is not None:
                bias[row, want] = 2e4
        return logits + mx.array(bias)


def run_apar(lm, plan, max_tokens=300, cache=None, **options):
    script = Script(plan, cache)
    resources = {"logits_processor": script}
    if cache is not None:
        resources["cache"] = cache
    params = GenerationParams(max_tokens=max_tokens, options=options)
    events = list(stream_events(lm, list(PROMPT), apar, params, "apar", resources=resources))
    return events, script


def thread_tokens(events):
    out = defaultdict(list)
    for e in events:
        if e.kind == "token":
            out[e.thread_id].extend(e.tokens)
    return out


def starts(events):
    return [(e.thread_id, e.parent_id) for e in events if e.kind == "thread_start"]


def decode_alone(model, sequence, first):
    """Plain decoding with a contiguous cache: logits after feeding sequence[i], i >= first."""
    cache = ContiguousKVCache.for_model(model)
    forward(model, mx.array(sequence[:first])[None], cache, logits_for="none")
    rows = []
    for token in sequence[first:]:
        rows.append(np.array(forward(model, mx.array([[token]]), cache, logits_for="last").logits[0, -1]))
    return rows


# Root forks at its samplings 1 and 4 and ends at 7; child 1 forks (grandchild) at 1 and ends
# at 3; child 2 ends at 2; grandchild 3 ends at 2. Root's fork at sampling 4 and child 1's at 1
# happen in the same step: row order (root first) makes the root's child id 2, the grandchild 3.
TREE_PLAN = {(0, 1): FORK, (0, 4): FORK, (0, 7): EOS,
             (1, 1): FORK, (1, 3): EOS,
             (2, 2): EOS,
             (3, 2): EOS}


def test_threads_start_where_scripted_and_every_thread_equals_its_root_path_alone():
    lm = make_apar_lm()
    events, script = run_apar(lm, TREE_PLAN)
    assert starts(events) == [(1, 0), (2, 0), (3, 1)]
    ends = [e.thread_id for e in events if e.kind == "thread_end"]
    assert sorted(ends) == [0, 1, 2, 3]
    done = events[-1]
    assert done.kind == "done" and done.stats.finish_reason == "stop"

    tree = tree_from_events(events)
    for thread in tree.threads:
        full = list(PROMPT) + tree.root_path(thread, FORK, CHILD)
        own = len(tree.stream(thread, FORK))
        first = len(PROMPT) - 1 if thread == 0 else len(full) - own - 1  # its first fed token
        want = decode_alone(lm.model, full, first)
        got = script.logits[thread]
        assert len(got) == len(want), thread
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_restore_order_is_depth_first_at_each_fork():
    lm = make_apar_lm()
    events, _ = run_apar(lm, TREE_PLAN)
    mine = thread_tokens(events)
    R, C1, C2, G3 = mine[0], mine[1], mine[2], mine[3]
    # root samplings: 0 tok, 1 FORK(child 1), 2 tok, 3 tok, 4 FORK(child 2), 5 tok, 6 tok, 7 EOS
    assert len(R) == 5 and len(C1) == 2 and len(C2) == 2 and len(G3) == 2
    want = R[:1] + C1[:1] + G3 + C1[1:] + R[1:3] + C2 + R[3:]
    assert restore_tokens(events) == want
    assert restore_answer(events, lm.tokenizer) == lm.tokenizer.decode(want)
    # control tokens and EOS never reach the event stream
    assert not {FORK, CHILD, EOS} & {t for e in events if e.kind == "token" for t in e.tokens}
    # the driver counted every thread's tokens
    assert events[-1].stats.generated_tokens == len(want)


def test_shared_prefix_is_not_copied_and_freed_threads_release_their_slots():
    lm = make_apar_lm()
    cache = ForkableKVCache.for_model(lm.model)
    plan = {(0, 1): FORK, (0, 14): EOS, (1, 3): EOS}
    events, script = run_apar(lm, plan, cache=cache)
    assert starts(events) == [(1, 0)]
    P = len(PROMPT)
    both = [s for s in script.steps if set(s[0]) == {0, 1}]
    assert both, "the two threads decoded together"
    for order, live, high, paths, free in script.steps:
        assert set(paths) == set(order)  # only live threads hold a path
        union = set().union(*paths.values())
        assert live == len(union)  # memory in use = distinct slots of live threads
    for order, live, high, paths, free in both:
        # the child's path starts with the very slots of the parent's prompt and tokens up to
        # and including its [Fork]: shared by id, stored once
        fork_at = P + 2  # prompt, the root's first token, its [Fork]
        assert paths[1][:fork_at] == paths[0][:fork_at]
        assert not set(paths[1][fork_at:]) & set(paths[0][fork_at:])
        assert live == len(paths[0]) + len(paths[1]) - fork_at < len(paths[0]) + len(paths[1])
    # after the child's EOS its own slots are free; the root's next tokens reuse them
    child_end = max(i for i, s in enumerate(script.steps) if 1 in s[0])
    last_with_child = script.steps[child_end]
    after = script.steps[child_end + 1]
    child_own = set(last_with_child[3][1][P + 2:])
    assert set(after[4]) | set(after[3][0]) >= child_own
    assert after[1] == len(after[3][0])  # only the root's path is live
    highs = [s[2] for s in script.steps[child_end + 1 : child_end + 1 + len(child_own)]]
    assert len(set(highs)) == 1  # the pool does not grow while freed slots are reused
    assert cache.paths == {}  # everything released when the answer ends


@pytest.mark.parametrize("max_threads", [1, 2, 3])
def test_thread_limit_holds(max_threads):
    lm = make_apar_lm()
    # every thread asks to fork at every other sampling; all end after 9 samplings
    plan = {}
    for thread in range(12):
        for k in (1, 3, 5, 7):
            plan[(thread, k)] = FORK
        plan[(thread, 9)] = EOS
    events, script = run_apar(lm, plan, max_depth=5, max_threads=max_threads)
    rows = [len(order) for order in script.orders]
    assert max(rows) <= max_threads
    assert len(set(t for t, _ in starts(events))) <= 11
    if max_threads == 1:
        assert starts(events) == []
    else:
        assert max(rows) == max_threads  # the limit is reached, not just respected


def test_depth_limit_and_control_token_rules():
    lm = make_apar_lm()
    plan = {(0, 1): FORK, (0, 2): FORK,  # right after feeding its [Fork]: not allowed
            (1, 0): FORK,  # a child's first sampling, right after [Child]: not allowed
            (1, 2): FORK,  # depth 1 child at max_depth 1: not allowed
            (0, 6): EOS, (1, 5): EOS}
    for row_thread in (0, 1):
        for k in range(6):
            plan.setdefault((row_thread, k), CHILD)  # [Child] is boosted everywhere else: never sampled
    events, script = run_apar(lm, plan, max_depth=1)
    assert starts(events) == [(1, 0)]
    mine = thread_tokens(events)
    assert CHILD not in mine[0] + mine[1] and FORK not in mine[0] + mine[1]
    assert len(mine[0]) == 5 and len(mine[1]) == 5  # every non-fork sampling wrote a word


def test_depth_zero_never_forks_and_equals_plain_greedy():
    lm = make_apar_lm()
    plan = {(0, 1): FORK, (0, 3): FORK, (0, 10): EOS}
    events, _ = run_apar(lm, plan, max_depth=0)
    assert starts(events) == []
    assert restore_tokens(events) == plain_greedy(lm.model, PROMPT, steps=10)


def plain_greedy(model, prompt, steps):
    """Plain greedy decoding (contiguous cache, one token a step) under the Script's rules for a
    thread that may not fork: [Fork], [Child] and EOS are never picked."""
    cache = ContiguousKVCache.for_model(model)
    logits = forward(model, mx.array(prompt)[None], cache, logits_for="last").logits[0, -1]
    out = []
    for _ in range(steps):
        row = np.array(logits)
        row[[FORK, CHILD, EOS]] = -np.inf
        out.append(int(row.argmax()))
        logits = forward(model, mx.array([[out[-1]]]), cache, logits_for="last").logits[0, -1]
    return out


def test_stats_report_threads_and_flattened_figures():
    lm = make_apar_lm()
    cache = ForkableKVCache.for_model(lm.model)
    events, script = run_apar(lm, TREE_PLAN, cache=cache)
    stats = events[-1].stats
    extra = stats.extra
    T = len(restore_tokens(events))
    P = len(PROMPT)
    assert extra["threads"] == 4 and extra["forked"] is True
    assert extra["answer_tokens"] == T == stats.generated_tokens
    assert extra["decode_steps"] == stats.forward_passes == len(script.steps)
    assert extra["max_live_threads"] == max(len(s[0]) for s in script.steps)
    # peak memory: the largest set of live slots any step attended over
    assert extra["max_cached_tokens"] == max(max(s[1] for s in script.steps), P - 1)
    rows = sum(len(s[0]) for s in script.steps)
    attended = sum(len(s[3][t]) for s in script.steps for t in s[0])
    assert extra["attended_tokens_mean"] == round(attended / rows, 2)
    assert extra["control_tokens"] == 2 * 3
    # The flat figures are what plain decoding of the flattened answer measures: decode exactly
    # the restored tokens then EOS with one thread (the same counters, nothing can fork).
    answer = restore_tokens(events)
    flat_plan = {(0, k): token for k, token in enumerate(answer)}
    flat_plan[(0, len(answer))] = EOS
    flat_events, flat_script = run_apar(lm, flat_plan, cache=ForkableKVCache.for_model(lm.model), max_depth=0)
    assert restore_tokens(flat_events) == answer
    measured = flat_events[-1].stats.extra
    assert measured["decode_steps"] == len(flat_script.steps)
    for key in ("decode_steps", "max_cached_tokens", "attended_tokens_mean"):
        assert extra[f"flat_{key}"] == measured[key], key
    assert extra["decode_steps"] < extra["flat_decode_steps"]
    assert "4 threads" in stats.summary() and "(flat)" in stats.summary()


@pytest.mark.parametrize("ends_with_eos", [True, False])
def test_an_unforked_answer_is_its_own_flattened_answer(ends_with_eos):
    """No fork: APAR's own counters equal its flat figures, whether EOS or max_tokens ends it."""
    lm = make_apar_lm()
    plan = {(0, 12): EOS} if ends_with_eos else {}
    events, _ = run_apar(lm, plan, max_tokens=20 if ends_with_eos else 9, max_depth=0)
    extra = events[-1].stats.extra
    assert events[-1].stats.finish_reason == ("stop" if ends_with_eos else "length")
    for key in ("decode_steps", "max_cached_tokens", "attended_tokens_mean"):
        assert extra[f"flat_{key}"] == extra[key], key


def test_parallel_threads_cache_and_attend_less_than_the_flattened_answer():
    """Three details written in parallel and freed early: fewer steps, a smaller peak cache and
    fewer attended tokens than the same answer decoded sequentially (each fork costs two control
    tokens, so a tiny tree would not show it)."""
    lm = make_apar_lm()
    plan = {(0, 1): FORK, (0, 3): FORK, (0, 5): FORK, (0, 33): EOS,
            (1, 10): EOS, (2, 10): EOS, (3, 10): EOS}
    events, _ = run_apar(lm, plan)
    extra = events[-1].stats.extra
    assert extra["answer_tokens"] == 30 + 3 * 10
    assert extra["decode_steps"] < extra["flat_decode_steps"]
    assert extra["max_cached_tokens"] < extra["flat_max_cached_tokens"]
    assert extra["attended_tokens_mean"] < extra["flat_attended_tokens_mean"]


def test_max_tokens_counts_every_thread_and_stops_cleanly():
    lm = make_apar_lm()
    cache = ForkableKVCache.for_model(lm.model)
    plan = {(0, 1): FORK, (0, 3): FORK, (0, 40): EOS, (1, 40): EOS, (2, 40): EOS}
    events, _ = run_apar(lm, plan, max_tokens=12, cache=cache)
    stats = events[-1].stats
    assert stats.generated_tokens == 12 and stats.finish_reason == "length"
    assert len(restore_tokens(events)) == 12
    assert cache.paths == {}  # the strategy's finally released every thread


def test_sampling_runs_and_keeps_the_rules():
    lm = make_apar_lm()
    params = GenerationParams(max_tokens=40, temperature=1.0, seed=3)
    script = Script({(0, 1): FORK, (0, 2): CHILD})
    events = list(stream_events(lm, list(PROMPT), apar, params, "apar",
                                resources={"logits_processor": script}))
    assert starts(events)[:1] == [(1, 0)]
    assert not {FORK, CHILD} & set(restore_tokens(events))


def test_control_tokens_found_by_name_and_missing_ones_refused():
    lm = make_apar_lm()
    found = control_tokens_for(lm)
    assert (found.fork, found.child, found.convention) == (FORK, CHILD, "project")
    plain = make_tiny_lm()
    assert control_tokens_for(plain) is None
    with pytest.raises(NoControlTokens, match="control tokens"):
        list(Engine(plain).generate_ids(PROMPT, "apar", GenerationParams(max_tokens=4)))


def bench_tiny_ar_and_apar():
    """ar and apar (forking off) in `run_bench` on two prompts of the tiny APAR model."""
    from mlx_specdec.bench import MethodConfig, Prompt, run_bench

    lm = make_apar_lm()
    lm.tokenizer._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    engine = Engine(lm)
    prompts = [Prompt("1", "generic", "w5 w17 w42 w3"), Prompt("2", "coding", "w60 w61")]
    result = run_bench(engine, prompts, [MethodConfig("ar"), MethodConfig("apar", {"max_depth": 0})],
                       GenerationParams(max_tokens=10), progress=False)
    return result


def test_bench_rows_carry_the_whole_restored_answer_and_the_apar_figures():
    result = bench_tiny_ar_and_apar()
    rows = {(r["method"], r["prompt_id"]): r for r in result["rows"]}
    for pid in ("1", "2"):
        apar_row = rows[("apar", pid)]
        assert apar_row["threads"] == 1 and apar_row["forked"] is False
        assert apar_row["flat_max_cached_tokens"] == apar_row["max_cached_tokens"]  # unforked: it IS flat
        assert apar_row["identical_to_ar"]  # no forks allowed: plain greedy decoding of the same model
    assert "threads" not in rows[("ar", "1")]


def test_bench_scores_every_answer_under_the_original_model_for_the_quality_guard():
    from mlx_specdec.bench_report import render

    result = bench_tiny_ar_and_apar()
    for row in result["rows"]:
        assert row["answer_nll"] > 0 and "_tokens" not in row
    summary = {s["method"]: s for s in result["summary"]}
    # no forks allowed: the same greedy answers, so the same scores and a guard ratio of exactly 1
    assert summary["apar"]["nll_vs_ar"] == 1.0
    assert summary["apar"]["forked_fraction"] == 0.0 and summary["apar"]["threads_mean"] == 1.0
    assert "## Per category" in render(result, "md")


def test_answer_nll_is_the_mean_teacher_forced_nll_of_the_answer():
    from mlx_specdec.apar.quality import answer_nll

    lm = make_apar_lm()
    answer = [7, 30, 12, 55]
    ids = PROMPT + answer
    logits = lm.model(mx.array(ids)[None])[0].astype(mx.float32)  # mlx-lm's own call, causal
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    expected = -np.mean([logprobs[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(answer)])
    text = lm.tokenizer.decode(answer)
    assert answer_nll(lm, PROMPT, text) == pytest.approx(expected, rel=1e-5)
    assert np.isnan(answer_nll(lm, PROMPT, ""))


def test_plain_printer_prints_apars_restored_answer_and_keeps_unfinished_threads(capsys):
    from mlx_specdec.cli.printer import AnswerPrinter
    from mlx_specdec.decoding.base import Event

    lm = make_apar_lm()
    events = [Event("token", 0, None, [10], "w10"), Event("thread_start", 1, 0),
              Event("token", 0, None, [11], " w11"), Event("token", 1, 0, [20], "w20"),
              Event("thread_end", 1, 0), Event("token", 0, None, [12], " w12"), Event("done")]
    printer = AnswerPrinter(lm.tokenizer, verbose=False, restore=True)
    for event in events[:4]:
        printer.feed(event)
    assert capsys.readouterr().out == "w10"  # a child is live: the parent's later text waits for it
    for event in events[4:]:
        printer.feed(event)
    assert printer.text == lm.tokenizer.decode([10, 20, 11, 12])
    assert capsys.readouterr().out == printer.text[len("w10"):] + "\n"

    stopped = AnswerPrinter(lm.tokenizer, verbose=False, restore=True)
    for event in events[:4]:  # Ctrl-C while thread 1 is still writing
        stopped.feed(event)
    stopped.finish()
    assert stopped.text == lm.tokenizer.decode([10, 20, 11])


def forking_apar_lm(seed: int, fork: float, eos: float = 1.0) -> LoadedModel:
    """A tiny random APAR model with its [Fork] and EOS head rows scaled up, so that it forks
    and ends threads on its own (no script)."""
    lm = make_apar_lm(seed)
    weight = mx.array(lm.model.lm_head.weight)
    weight[FORK] = weight[FORK] * fork
    weight[EOS] = weight[EOS] * eos
    lm.model.lm_head.weight = weight
    return lm


@pytest.mark.parametrize("seed,boost", [(1, 2.0), (2, 2.0), (3, 1.5), (3, 2.0)])
def test_speculated_next_steps_change_nothing(seed, boost):
    """The pipelined loop (the next step queued before this step's tokens are read, each thread
    feeding what it samples) writes exactly the threads of the step-by-step loop. A random model
    with its [Fork] and EOS rows scaled up forks and ends threads on its own, many times per answer."""
    lm = forking_apar_lm(seed, fork=boost, eos=boost)
    runs = {}
    for speculate in (False, True):
        cache = ForkableKVCache.for_model(lm.model)
        params = GenerationParams(max_tokens=120, options={"speculate": speculate})
        events = list(stream_events(lm, list(PROMPT), apar, params, "apar", resources={"cache": cache}))
        assert cache.paths == {} and cache.live_slots == 0  # every slot, queued ones too, released
        runs[speculate] = events
    strip = lambda events: [(e.kind, e.thread_id, e.parent_id, e.tokens) for e in events if e.kind != "done"]
    assert strip(runs[True]) == strip(runs[False])
    assert len(starts(runs[True])) >= 2
    for key in ("decode_steps", "max_cached_tokens", "attended_tokens_mean", "threads"):
        assert runs[True][-1].stats.extra[key] == runs[False][-1].stats.extra[key], key


def test_forks_and_ends_keep_the_queued_step():
    """A thread that forks feeds [Fork] next, as the queued step guessed, and one that ends only
    wastes its own row: neither drops the queued step (each used to cost one whole forward)."""
    lm = forking_apar_lm(3, fork=2.0, eos=2.0)
    for options, least in (({"sibling_penalty": 0.0}, 20), ({}, 5)):  # the sibling rule off, then on
        params = GenerationParams(max_tokens=120, options=options)
        events = list(stream_events(lm, list(PROMPT), apar, params, "apar"))
        stats = events[-1].stats
        forks, ends = len(starts(events)), sum(e.kind == "thread_end" for e in events)
        assert forks >= least and ends >= least
        assert stats.extra["dropped_steps"] == 0
        assert stats.forward_passes == stats.extra["decode_steps"] + stats.extra["dropped_steps"]


def test_sampling_keeps_the_queued_step_and_the_rules():
    """When sampling, the queued step is fed what each thread writes by this step's rules (the
    no-[Fork] pick for threads that may not fork: here every child, at the depth limit), so
    nothing is dropped; no control token leaks into the answer and no child forks."""
    lm = forking_apar_lm(2, fork=2.0)
    params = GenerationParams(max_tokens=80, temperature=1.0, seed=5, options={"max_depth": 1})
    events = list(stream_events(lm, list(PROMPT), apar, params, "apar"))
    stats = events[-1].stats
    assert len(starts(events)) >= 1
    assert all(parent == 0 for _, parent in starts(events))  # depth limit 1: only the root forks
    assert not {FORK, CHILD} & set(restore_tokens(events))
    assert stats.extra["dropped_steps"] == 0, stats.extra


@pytest.mark.parametrize("max_threads", [1, 2, 3])
def test_a_tight_thread_limit_drops_nothing_and_changes_nothing(max_threads):
    """Threads that want to fork at the thread limit write their no-[Fork] token; the queued step
    is fed exactly that, so the pipelined loop drops nothing and writes the step-by-step threads."""
    lm = forking_apar_lm(3, fork=2.0, eos=2.0)
    runs = {}
    for speculate in (False, True):
        params = GenerationParams(max_tokens=120, options={"speculate": speculate, "max_threads": max_threads})
        runs[speculate] = list(stream_events(lm, list(PROMPT), apar, params, "apar"))
    strip = lambda events: [(e.kind, e.thread_id, e.parent_id, e.tokens) for e in events if e.kind != "done"]
    assert strip(runs[True]) == strip(runs[False])
    assert runs[True][-1].stats.extra["dropped_steps"] == 0
    assert runs[True][-1].stats.extra["max_live_threads"] <= max_threads
