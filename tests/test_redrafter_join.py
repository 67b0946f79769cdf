"""ReDrafter as a continuous batch (decoding/redrafter_join.py): requests that join a running
batch at any step write exactly their greedy answer alone, drafts and all; a row's stop string
or cancel ends that row only; the cache sheds what no row uses; a joining row resumes from the
prompt cache; sampled rows draw the target's own distribution."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_tiny_lm
from mlx_specdec.cache.prefix import PrefixStore
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.engine import Engine
from test_redrafter import PROMPTS, engine_with, oracle_head, run
from test_triforce import chi_square_below_critical

MORE = PROMPTS + [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [40]]
LIMITS = [20, 35, 12, 30, 25]
SETTINGS = [{}, {"beam_width": 2, "beam_length": 4, "draft_cutoff": 0.0}, {"lookup": 0}, {"runners_up": 0}]


def tiny_engine():
    lm = make_tiny_lm(seed=4, eos_id=96)
    return engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def drive(decoder, joins, params_of, cancel_at=None):
    """joins: {step: [prompt index]}; cancel_at: {step: prompt index}. -> {index: (tokens, text, stats)}."""
    ident_of, out, step = {}, {}, 0
    while step == 0 or decoder.live or any(s >= step for s in joins):
        for i in joins.get(step, []):
            ident_of[decoder.join(MORE[i], params_of(i))] = i
        if cancel_at and step in cancel_at:
            ident = next(k for k, v in ident_of.items() if v == cancel_at[step])
            events = decoder.cancel(ident)
            out[cancel_at[step]] = out.get(cancel_at[step], ([], "", None))[:2] + (events[-1].stats,)
        for event in decoder.step():
            i = ident_of[event.thread_id]
            tokens, text, stats = out.get(i, ([], "", None))
            assert stats is None  # nothing after a row's end
            if event.kind == "token":
                out[i] = (tokens + event.tokens, text + event.text, None)
            else:
                out[i] = (tokens, text, event.stats)
        step += 1
        assert step < 400
    return out


@pytest.mark.parametrize("options", SETTINGS)
def test_rows_that_join_at_any_step_write_what_they_write_alone(engine, options):
    params_of = lambda i: GenerationParams(max_tokens=LIMITS[i], options=options)  # noqa: E731
    decoder = engine.continuous_decoder("redrafter", params_of(0))
    out = drive(decoder, {0: [0, 1], 2: [2], 5: [3], 9: [4]}, params_of)
    accepted = 0
    for i in range(len(MORE)):
        want, _ = run(engine, MORE[i], "ar", max_tokens=LIMITS[i])
        tokens, _, stats = out[i]
        assert tokens == want, i
        assert stats.generated_tokens == len(want) and stats.prompt_tokens == len(MORE[i])
        assert stats.finish_reason == ("length" if len(want) == LIMITS[i] else "stop")
        assert 0 < stats.forward_passes <= len(want)
        accepted += stats.accepted
    assert accepted > 0  # it speculated


def test_rows_with_penalties_write_what_they_write_alone(engine):
    pen = dict(presence_penalty=1.5, repetition_penalty=1.3, frequency_penalty=0.2)
    params_of = lambda i: GenerationParams(max_tokens=LIMITS[i], **pen)  # noqa: E731
    out = drive(engine.continuous_decoder("redrafter", params_of(0)), {0: [0], 1: [1, 2], 4: [3], 6: [4]}, params_of)
    for i in range(len(MORE)):
        assert out[i][0] == run(engine, MORE[i], "ar", max_tokens=LIMITS[i], **pen)[0], i


def test_a_row_s_stop_string_and_cancel_end_that_row_only(engine):
    full = "".join(e.text for e in engine.generate_ids(MORE[1], "ar", GenerationParams(max_tokens=30))
                   if e.kind == "token")
    stop = full[len(full) // 2: len(full) // 2 + 3]
    params = [GenerationParams(max_tokens=30, stop=(stop,)), GenerationParams(max_tokens=30),
              GenerationParams(max_tokens=30), GenerationParams(max_tokens=30)]
    order = {0: 1, 1: 0, 2: 3, 3: 4}  # a row of the decoder -> the prompt it decodes
    decoder = engine.continuous_decoder("redrafter", GenerationParams())
    out = drive(decoder, {0: [1, 0], 1: [3], 3: [4]}, lambda i: params[[k for k, v in order.items() if v == i][0]],
                cancel_at={2: 3})
    assert out[1][1] == full[: full.index(stop)] and out[1][2].finish_reason == "stop"
    assert out[3][2].finish_reason == "cancelled"
    for i in (0, 4):
        want, _ = run(engine, MORE[i], "ar", max_tokens=30)
        assert out[i][0] == want


def test_the_cache_sheds_slots_no_row_uses(engine):
    decoder = engine.continuous_decoder("redrafter", GenerationParams())
    widths = []
    long_prompt = list(range(3, 90))
    first = decoder.join(long_prompt, GenerationParams(max_tokens=8))
    for step in range(60):
        if step % 6 == 0:
            decoder.join(MORE[step // 6 % 3], GenerationParams(max_tokens=10))
        decoder.step()
        if decoder.loop.cache is not None and decoder.live:
            widths.append(decoder.loop.valid.shape[1])
            assert decoder.loop.valid.shape == (len(decoder.loop.rows), decoder.loop.cache.offset) or \
                decoder.loop.keep is not None
    assert first not in {row.ident for row in decoder.rows}
    assert max(widths) >= len(long_prompt) and widths[-1] < len(long_prompt)  # the long row's slots were cut


def test_a_joining_row_resumes_from_the_prompt_cache():
    lm = make_tiny_lm(seed=4, eos_id=96)
    engine = Engine(lm, drafter=None, reuse_prefix=PrefixStore())
    engine._resources["drafter"] = oracle_head(lm, PROMPTS, corrupt=0.3)
    turn = MORE[3] + [50, 51]
    first = drive(engine.continuous_decoder("redrafter", GenerationParams()), {0: [3]},
                  lambda i: GenerationParams(max_tokens=10))
    assert first[3][2].cached_tokens == 0
    decoder = engine.continuous_decoder("redrafter", GenerationParams())
    ident = decoder.join(turn, GenerationParams(max_tokens=12))
    events = []
    while decoder.live:
        events += [e for e in decoder.step() if e.thread_id == ident]
    assert events[-1].stats.cached_tokens == len(MORE[3]) - 1
    want, _ = run(Engine(lm, drafter=None), turn, "ar", max_tokens=12)
    assert [t for e in events if e.kind == "token" for t in e.tokens] == want


def test_what_cannot_join_says_so(engine, tiny_lm):
    assert engine.joins("redrafter", GenerationParams()) and engine.joins("ar", GenerationParams())
    assert not engine.joins("redrafter", GenerationParams(temperature=0.7, options={"sampled_drafts": True}))
    assert not engine.joins("triforce", GenerationParams()) and not engine.joins("apar", GenerationParams())
    with_model = Engine(engine.lm, drafter=None, draft_model=tiny_lm)
    assert not with_model.joins("redrafter", GenerationParams())


def test_sampled_rows_draw_the_target_s_distribution(engine):
    """Rows joining at every step, two tokens each at T 1.0: the second token's marginal over
    every row is the target's sum_t1 p(t1) p(t2 | t1) (t1 not EOS), computed exactly."""
    import mlx.core as mx

    from mlx_specdec.model.forward import forward

    prompt = MORE[0]
    model = engine.lm.model

    def probs(tokens):
        logits = forward(model, mx.array([tokens]), None, logits_for="last").logits[0, -1]
        return np.array(mx.softmax(logits.astype(mx.float32)))

    first = probs(prompt)
    eos = 96  # the tiny model's: not emitted, so a row that writes it second shows one token
    want = sum(first[t1] * probs(prompt + [t1]) for t1 in range(len(first)) if first[t1] > 1e-6 and t1 != eos)
    params = GenerationParams(max_tokens=2, temperature=1.0)
    mx.random.seed(11)
    decoder = engine.continuous_decoder("redrafter", params)
    rows, seconds, joined = {}, [], 0
    while joined < 1500 or decoder.live:
        for _ in range(4 if joined < 1500 else 0):
            rows[decoder.join(prompt, params)] = []
            joined += 1
        for event in decoder.step():
            rows[event.thread_id].extend(event.tokens)
            if event.kind == "done":
                written = rows[event.thread_id]
                if written:  # a first token of EOS leaves no second
                    seconds.append(written[1] if len(written) == 2 else eos)
    assert len(seconds) > 1400
    ok, figures = chi_square_below_critical(seconds, want / want.sum())
    assert ok, figures


def test_a_single_redrafter_request_resumes_from_the_prompt_cache_too():
    """The chat's path (one request, `generate_ids`): the next turn resumes from this one's prompt."""
    lm = make_tiny_lm(seed=4, eos_id=96)
    engine = Engine(lm, drafter=None, reuse_prefix=PrefixStore())
    engine._resources["drafter"] = oracle_head(lm, PROMPTS, corrupt=0.3)
    turn = MORE[3] + [50, 51]
    first = list(engine.generate_ids(MORE[3], "redrafter", GenerationParams(max_tokens=10)))
    assert first[-1].stats.cached_tokens == 0
    events = list(engine.generate_ids(turn, "redrafter", GenerationParams(max_tokens=12)))
    assert events[-1].stats.cached_tokens == len(MORE[3]) - 1
    assert [t for e in events if e.kind == "token" for t in e.tokens] == run(Engine(lm, drafter=None), turn, "ar",
                                                                             max_tokens=12)[0]


def _serve(load, jobs_of, max_batch_bytes=None, stagger_s=0.0):
    """The server's generation thread (serve/worker.py) on load()'s engine (made on that thread, as
    MLX wants): jobs_of(loop) -> jobs to submit
    (one every stagger_s); -> each job's (tokens, done stats), in order."""
    import asyncio

    from mlx_specdec.serve.worker import DONE, GenerationWorker

    async def run():
        worker = GenerationWorker(load, max_batch=8, max_batch_bytes=max_batch_bytes)
        worker.wait_ready()
        jobs = []
        for job in jobs_of(asyncio.get_running_loop()):
            jobs.append(worker.submit(job))
            await asyncio.sleep(stagger_s)
        out = []
        for job in jobs:
            tokens, stats = [], None
            while (item := await asyncio.wait_for(job.events.get(), 60)) is not DONE:
                assert not isinstance(item, Exception), item
                tokens += item.tokens
                stats = item.stats or stats
            out.append((tokens, stats))
        worker.stop()
        worker.join(5)
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("bound", [None, 1])
def test_the_server_s_rows_join_within_the_memory_bound(engine, bound):
    """Redrafter requests arriving one after another join one running batch (batch_rows > 1) and
    each writes ar's answer; with a 1-byte bound no row joins another (each waits its turn)."""
    from mlx_specdec.serve.worker import Job

    def jobs_of(loop):
        return [Job(MORE[i], "redrafter", GenerationParams(max_tokens=LIMITS[i]), loop) for i in range(len(MORE))]

    out = _serve(tiny_engine, jobs_of, max_batch_bytes=bound, stagger_s=0.01)
    for i, (tokens, stats) in enumerate(out):
        assert tokens == run(engine, MORE[i], "ar", max_tokens=LIMITS[i])[0], i
    rows = [stats.extra["batch_rows"] for _, stats in out]
    assert (max(rows) > 1) if bound is None else rows == [1] * len(MORE), rows


def test_auto_requests_join_a_small_running_redrafter_batch_and_wait_beside_a_big_one():
    """`auto` takes a running batch's method while a redrafter batch has fewer than
    join_spec_rows() rows; past that it chooses by itself (busy: `ar`) and waits for the drain."""
    from mlx_specdec.auto import join_spec_rows
    from mlx_specdec.serve.worker import Job

    JOIN_SPEC_ROWS = join_spec_rows()
    count = JOIN_SPEC_ROWS + 2

    def jobs_of(loop):
        first = Job(MORE[1], "redrafter", GenerationParams(max_tokens=60), loop)
        return [first] + [Job(MORE[i % 3], "auto", GenerationParams(max_tokens=4), loop) for i in range(count)]

    out = _serve(tiny_engine, jobs_of, stagger_s=0.0)
    chose = [stats.extra["auto"] for _, stats in out[1:]]
    joined = [c["chose"] == "redrafter" and "joins the running" in c["why"] for c in chose]
    assert joined == [True] * (JOIN_SPEC_ROWS - 1) + [False] * (count - JOIN_SPEC_ROWS + 1), chose
    assert all(c["chose"] == "ar" for c, j in zip(chose, joined) if not j)
    engine = tiny_engine()
    for (tokens, _), i in zip(out[1:], range(count)):
        assert tokens == run(engine, MORE[i % 3], "ar", max_tokens=4)[0]
