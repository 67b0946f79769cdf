"""A batch of requests decoded together (decoding/batch.py): each row keeps its own max_tokens,
stop strings and end, gets its own stats, and a cancelled or finished row leaves the batch."""

from mlx_specdec.decoding import GenerationParams
from mlx_specdec.decoding.batch import stream_batch
from mlx_specdec.decoding.redrafter import redrafter

from conftest import make_tiny_lm
from test_redrafter import PROMPTS, engine_with, oracle_head, run

OPTIONS = {"beam_width": 2, "beam_length": 4, "draft_cutoff": 0.0}


def tiny_engine():
    lm = make_tiny_lm(seed=4, eos_id=96)
    return engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))


def per_row(events, n):
    tokens, text, ends = [[] for _ in range(n)], [""] * n, {}
    for e in events:
        if e.kind == "token":
            assert e.thread_id not in ends  # nothing after a row's end
            tokens[e.thread_id].extend(e.tokens)
            text[e.thread_id] += e.text
        elif e.kind == "thread_end":
            ends[e.thread_id] = e.stats
    return tokens, text, ends


def test_rows_keep_their_own_max_tokens_and_report_their_own_stats():
    engine = tiny_engine()
    limits = [5, 12, 30]
    want = [run(engine, p, "ar", max_tokens=m)[0] for p, m in zip(PROMPTS, limits)]
    rows = [GenerationParams(max_tokens=m) for m in limits]
    events = list(engine.generate_ids_batch(PROMPTS, "redrafter", GenerationParams(options=OPTIONS), rows=rows))
    tokens, _, ends = per_row(events, 3)
    assert tokens == want
    assert sorted(ends) == [0, 1, 2] and events[-1].kind == "done"
    for b, stats in ends.items():
        assert stats.generated_tokens == len(want[b]) and stats.prompt_tokens == len(PROMPTS[b])
        assert stats.finish_reason == ("length" if len(want[b]) == limits[b] else "stop")
        assert 0 < stats.forward_passes <= stats.generated_tokens
        assert stats.extra["batch_size"] == 3
    assert events[-1].stats.generated_tokens == sum(len(w) for w in want)


def test_a_row_stop_string_ends_that_row_only():
    engine = tiny_engine()
    alone = [list(engine.generate_ids(p, "ar", GenerationParams(max_tokens=20))) for p in PROMPTS[:2]]
    full_text = ["".join(e.text for e in events if e.kind == "token") for events in alone]
    words = full_text[0].split()
    stop = words[3]  # row 0 stops before its fourth word
    rows = [GenerationParams(max_tokens=20, stop=[stop]), GenerationParams(max_tokens=20)]
    events = list(engine.generate_ids_batch(PROMPTS[:2], "redrafter", GenerationParams(options=OPTIONS), rows=rows))
    _, text, ends = per_row(events, 2)
    assert text[0] == full_text[0][: full_text[0].index(stop)]
    assert ends[0].finish_reason == "stop"
    assert text[1] == full_text[1]


def test_a_cancelled_row_leaves_the_batch_and_the_others_are_unaffected():
    engine = tiny_engine()
    want = [run(engine, p, "ar", max_tokens=30)[0] for p in PROMPTS]
    seen_steps = {b: 0 for b in range(3)}
    token_events = {b: 0 for b in range(3)}

    def counting(ctx):  # the strategy, with the steps it yields per row counted
        for step in redrafter(ctx):
            seen_steps[step.thread_id] += 1
            yield step

    def cancelled(row):
        return row == 1 and token_events[1] >= 2

    events = []
    for e in stream_batch(engine.lm, PROMPTS, counting, GenerationParams(max_tokens=30, options=OPTIONS),
                          "redrafter", resources={"drafter": engine.drafter}, cancelled=cancelled):
        if e.kind == "token":
            token_events[e.thread_id] += 1
        events.append(e)
    tokens, _, ends = per_row(events, 3)
    assert ends[1].finish_reason == "cancelled"
    assert tokens[1] == want[1][: len(tokens[1])] and len(tokens[1]) < len(want[1])
    assert seen_steps[1] == 3  # two delivered, the third found the row cancelled; none after
    assert tokens[0] == want[0] and tokens[2] == want[2]
