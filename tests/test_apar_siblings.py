"""The sibling rule (`apar/siblings.py`): a line is pushed off the heads its threads already wrote.

Unit tests on a stub tokenizer (which ids are line breaks, letters, marks), then the rule inside
`apar` on the tiny random APAR model: a scripted answer whose second child would open exactly as
the first, the pipelined loop with the rule, and answers that never fork (or fork once) unchanged.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec.apar.siblings import SiblingRule
from mlx_specdec.decoding import GenerationParams, stream_events
from mlx_specdec.decoding.apar import apar

from test_apar_decoding import EOS, FORK, PROMPT, forking_apar_lm, make_apar_lm, starts, thread_tokens

NL, ONE, DOT, BOLD, PACK, A, BIKE, END, TWO, YOUR = range(1, 11)
TEXTS = {NL: "\n", ONE: "1", DOT: ".", BOLD: " **", PACK: " Pack", A: " a", BIKE: " Bike", END: "**:",
         TWO: "2", YOUR: " your"}


class StubTokenizer:
    def decode(self, ids):
        return "".join(TEXTS[i] for i in ids)


def write(rule, thread, tokens, first_step):
    for k, token in enumerate(tokens):
        rule.wrote(thread, token, first_step + k)


def parent_with_one_head():
    """Thread 0 wrote "1. ** Pack a Bike**:" in steps 1-7, forked at step 8, then "\n2. **" in 10-13."""
    rule = SiblingRule(StubTokenizer(), penalty=3.0)
    rule.start(0, None)
    write(rule, 0, [ONE, DOT, BOLD, PACK, A, BIKE, END], 1)
    rule.forked(0, 8)
    rule.start(1, 0)
    write(rule, 0, [NL, TWO, DOT, BOLD], 10)
    return rule


def test_a_parents_new_line_is_pushed_off_its_earlier_head_after_the_first_word():
    rule = parent_with_one_head()
    # step 11 builds on tokens <= 9: the row is still on the head's own line
    assert rule.pairs([0], 11) == []
    # from step 12 (the line break read) until a letter: if the row feeds " Pack", push it off " a"
    # (the first word is free: nothing is pushed off " Pack" itself)
    for step in (12, 14, 15):
        assert rule.pairs([0], step) == [(0, PACK, A)]
    rule.wrote(0, PACK, 14)
    assert rule.pairs([0], 16) == [(0, A, BIKE)]  # following the head: the next token is pushed too
    rule.wrote(0, YOUR, 15)
    assert rule.pairs([0], 17) == []  # it left the head: nothing more


def test_tokens_count_only_from_two_steps_after_they_were_sampled():
    rule = SiblingRule(StubTokenizer(), penalty=3.0)
    rule.start(0, None)
    rule.start(1, 0)
    rule.start(2, 0)
    write(rule, 1, [PACK, A, BIKE], 5)  # the first child: steps 5, 6, 7
    # the second child's first row (it feeds its first token) at step 7 sees steps <= 5 of its sibling
    assert rule.pairs([2], 7) == []  # the sibling's opening is one token: nothing to continue yet
    assert rule.pairs([2], 8) == [(0, PACK, A)]
    assert rule.pairs([2], 9) == [(0, PACK, A)]
    rule.wrote(2, PACK, 8)
    assert rule.pairs([2], 10) == [(0, A, BIKE)]
    assert rule.pairs([1], 10) == []  # the first child has no earlier sibling
    # a later line of a child is not its opening
    write(rule, 2, [YOUR, NL], 9)
    assert rule.pairs([2], 13) == []
    # a parent's new line only from two steps after its line break was sampled
    write(rule, 0, [PACK, A, BIKE], 1)
    rule.forked(0, 4)
    write(rule, 0, [NL, PACK], 5)
    assert rule.pairs([0], 6) == []  # the line break not read yet: still the head's line
    assert rule.pairs([0], 7) == [(0, PACK, A)]


def test_the_penalty_lands_on_the_right_row_only_when_it_feeds_the_head():
    rule = parent_with_one_head()
    rule.start(2, None)  # another root-like thread: never touched
    logits = mx.zeros((2, 12))
    out = np.array(rule.apply(logits, mx.array([PACK, PACK]), [0, 2], 15))
    want = np.zeros((2, 12), dtype=np.float32)
    want[0, A] = -3.0
    np.testing.assert_array_equal(out, want)
    out = np.array(rule.apply(logits, mx.array([YOUR, PACK]), [0, 2], 15))  # it feeds another word
    np.testing.assert_array_equal(out, np.zeros((2, 12), dtype=np.float32))
    banned = SiblingRule(StubTokenizer(), penalty=float("inf"))
    banned.threads, banned.children = rule.threads, rule.children
    out = np.array(banned.apply(logits, mx.array([PACK, PACK]), [0, 2], 15))
    assert out[0, A] == -np.inf and np.isfinite(np.delete(out.ravel(), A)).all()


W = 30  # the tiny tokenizer's words: "w30", "w31", ... (letters)


class Chooser:
    """Logits processor: thread t's k-th sampling prefers plan[t][k] by 5 and `alt[t][k]` by 3."""

    def __init__(self, plan, alt):
        self.plan, self.alt, self.calls = plan, alt, {}

    def __call__(self, order, logits):
        out = np.full(logits.shape, -30.0, dtype=np.float32)
        for row, t in enumerate(order):
            k = self.calls.get(t, 0)
            self.calls[t] = k + 1
            steps = self.plan[min(t, 2)]
            out[row, steps[min(k, len(steps) - 1)]] = 5.0
            if k in self.alt:
                out[row, self.alt[k]] = 3.0
        return mx.array(out)


def scripted(penalty, children=2):
    # the root: w10, [Fork], w11 w12 w13, then (children 2) [Fork], w14, EOS; every child: w30 w31 w32 EOS
    root = [10, FORK, 11, 12, 13] + ([FORK] if children == 2 else [13]) + [14, EOS]
    chooser = Chooser({0: root, 1: [W, W + 1, W + 2, EOS], 2: [W, W + 1, W + 2, EOS]}, alt={1: 40})
    params = GenerationParams(max_tokens=100, options={"sibling_penalty": penalty})
    events = list(stream_events(make_apar_lm(), list(PROMPT), apar, params, "apar",
                                resources={"logits_processor": chooser}))
    return events


@pytest.mark.parametrize("penalty", [3.0, 100.0, float("inf")])
def test_a_second_child_cannot_open_with_its_siblings_words(penalty):
    off, on = scripted(0.0), scripted(penalty)
    assert starts(off) == starts(on) == [(1, 0), (2, 0)]
    assert thread_tokens(off)[2] == [W, W + 1, W + 2]  # without the rule: the first child's opening again
    assert thread_tokens(on)[2] == [W, 40, W + 2]  # the first word free, the second pushed off
    assert thread_tokens(on)[0] == thread_tokens(off)[0] and thread_tokens(on)[1] == thread_tokens(off)[1]


def test_an_answer_that_forks_once_is_unchanged():
    assert strip(scripted(float("inf"), children=1)) == strip(scripted(0.0, children=1))


def strip(events):
    return [(e.kind, e.thread_id, e.parent_id, e.tokens) for e in events if e.kind != "done"]


@pytest.mark.parametrize("seed", [1, 2])
def test_the_rule_is_the_same_with_the_next_step_queued(seed, monkeypatch):
    """The rule sees only what the host knows when the pipelined loop builds a step ahead: the
    threads are the same with the pipelining on or off, and the rule did push some rows (the
    answer differs from the one without it)."""
    pushed = []
    pairs = SiblingRule.pairs
    monkeypatch.setattr(SiblingRule, "pairs", lambda self, order, step: _count(pushed, pairs(self, order, step)))
    lm = forking_apar_lm(seed, fork=2.0, eos=2.0)
    runs = {}
    for speculate in (False, True):
        params = GenerationParams(max_tokens=120, options={"speculate": speculate, "sibling_penalty": float("inf")})
        runs[speculate] = list(stream_events(lm, list(PROMPT), apar, params, "apar"))
    assert strip(runs[True]) == strip(runs[False])
    assert len(starts(runs[True])) >= 2 and sum(pushed) > 0
    without = stream_events(lm, list(PROMPT), apar, GenerationParams(max_tokens=120, options={"sibling_penalty": 0}),
                            "apar")
    assert strip(without) != strip(runs[True])


def test_the_default_penalty_is_a_ban_in_effect():
    lm = forking_apar_lm(1, fork=2.0, eos=2.0)
    runs = [strip(stream_events(lm, list(PROMPT), apar, GenerationParams(max_tokens=120, temperature=temperature,
                                seed=3, options=options), "apar"))
            for temperature in (0.0, 1.0) for options in ({}, {"sibling_penalty": float("inf")})]
    assert runs[0] == runs[1] and runs[2] == runs[3]


def _count(pushed, result):
    pushed.append(len(result))
    return result


@pytest.mark.parametrize("options", [{"max_depth": 0}, {"max_threads": 1}])
def test_an_answer_that_never_forks_is_unchanged(options):
    lm = forking_apar_lm(3, fork=2.0, eos=2.0)
    runs = [strip(stream_events(lm, list(PROMPT), apar, GenerationParams(max_tokens=60, options={
        **options, "sibling_penalty": penalty}), "apar")) for penalty in (0.0, float("inf"))]
    assert runs[0] == runs[1]
