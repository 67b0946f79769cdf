"""ReDrafter's device step (decoding/redrafter_device.py): the same greedy answers as plain
decoding, one blocking read and one host-built array per step, a few verify shapes, exact
sampling at the nodes, and a stop mid-answer that leaves nothing behind."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlx_specdec import masks
from mlx_specdec.acceptance import sample_token, target_probs
from mlx_specdec.decoding import GenerationParams
from mlx_specdec.decoding.redrafter_device import DeviceLoop, beam_width, verify_width
from mlx_specdec.drafting.verify_cost import CostTable

from conftest import make_tiny_lm
from test_redrafter import PROMPTS, engine_with, oracle_head, random_head, run, run_batch
from test_sampling_match import chi_square_threshold

DEVICE = {"step": "device"}


def device_run(engine, prompt, **params):
    options = {**DEVICE, **params.pop("options", {})}
    return run(engine, prompt, "redrafter", options=options, **params)


def batch_answers(engine, prompts, **params):
    return run_batch(engine, prompts, **params)[0]


@pytest.mark.parametrize("options", [{}, {"lookup": 0}, {"draft_cutoff": 0.0, "lookup": 0},
                                     {"beam_width": 2, "beam_length": 4, "lookup": 0},
                                     {"runners_up": 0}, {"beam_length": 3}])
def test_the_device_step_writes_plain_decoding_s_greedy_answer(options):
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))
    drafted = 0
    for prompt in PROMPTS:
        want, _ = run(engine, prompt, "ar", max_tokens=40)
        got, stats = device_run(engine, prompt, max_tokens=40, options=dict(options))
        assert got == want
        drafted += stats.accepted
    assert drafted > 0  # drafts were really accepted


def test_the_device_step_with_a_random_head_and_a_penalty_writes_plain_decoding_s_answer():
    lm = make_tiny_lm(seed=1, eos_id=96)
    engine = engine_with(lm, random_head(lm, seed=1))
    for prompt in PROMPTS:
        want, _ = run(engine, prompt, "ar", max_tokens=30, repetition_penalty=1.3)
        got, _ = device_run(engine, prompt, max_tokens=30, repetition_penalty=1.3)
        assert got == want


def test_a_batch_with_holes_writes_each_row_s_plain_answer():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))
    wants = [run(engine, p, "ar", max_tokens=30)[0] for p in PROMPTS]
    got = batch_answers(engine, PROMPTS, max_tokens=30, options=dict(DEVICE))
    assert got == wants


def test_one_read_and_one_host_array_a_step_and_a_few_shapes():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))
    for temperature in (0.0, 0.7):
        _, stats = device_run(engine, PROMPTS[1], max_tokens=60, temperature=temperature, top_p=0.9, seed=1)
        assert stats.extra["syncs_per_step"] == 1.0
        assert stats.extra["host_arrays_per_step"] == 1.0
        assert stats.extra["verify_shapes"] <= 4
    _, host = run(engine, PROMPTS[1], "redrafter", max_tokens=60, options={"step": "host"})
    assert host.extra["syncs_per_step"] > 1.5 and host.extra["host_arrays_per_step"] > 2
    _, ar = run(engine, PROMPTS[1], "ar", max_tokens=60)
    assert (ar.extra["syncs_per_step"], ar.extra["host_arrays_per_step"], ar.extra["verify_shapes"]) == (1, 0, 1)


def test_stopping_mid_answer_rolls_the_queued_step_back():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))
    want, _ = run(engine, PROMPTS[0], "ar", max_tokens=40)
    params = GenerationParams(max_tokens=40, options=dict(DEVICE))
    stream = engine.generate_ids(PROMPTS[0], "redrafter", params)
    seen = []
    for event in stream:
        seen += event.tokens if event.kind == "token" else []
        if len(seen) >= 7:
            break
    stream.close()
    assert seen == want[: len(seen)]
    assert device_run(engine, PROMPTS[0], max_tokens=40)[0] == want


def test_seeded_sampling_on_the_device_step_is_reproducible():
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS))
    first = device_run(engine, PROMPTS[0], max_tokens=30, temperature=0.8, top_p=0.9, seed=7)[0]
    assert first == device_run(engine, PROMPTS[0], max_tokens=30, temperature=0.8, top_p=0.9, seed=7)[0]


def test_widths_come_from_a_few_buckets():
    assert [verify_width(n) for n in (1, 2, 4, 5, 9, 17, 70)] == [1, 4, 4, 8, 16, 32, 128]
    assert [beam_width(w) for w in (1, 2, 3, 5)] == [1, 2, 4, 8]


@pytest.mark.parametrize("parents", [[-1, 0, 1, 0, 3, -1, -1, -1], [-1, 0, 0, 1, 2, 3, 5, 6], [-1]])
def test_the_tree_mask_and_depths_built_on_the_device_are_the_host_s(parents):
    mask, depths = masks.tree_on_device(mx.array([parents], dtype=mx.int32))
    assert (np.array(mask[0, 0]) == masks.tree_mask_np(parents)).all()
    assert (np.array(depths[0]) == masks.tree_depths_np(parents)).all()


def test_a_node_s_own_token_is_the_target_s_sample_drawn_or_settled():
    """Two nodes over 1,500 tokens: one sharp, one so flat that about a tenth of its draws fall
    outside the nucleus (redrawn by the full rule, as `DeviceLoop.settle` does). 40,000 draws
    each, binned; chi-square."""
    rng = np.random.default_rng(0)
    V, draws = 1500, 40_000
    logits = np.stack([rng.normal(size=V) * 4.0, rng.normal(size=V) * 0.05]).astype(np.float32)
    params = SimpleNamespace(greedy=False, temperature=0.7, top_p=0.9)
    loop = SimpleNamespace(params=params)
    batch = mx.broadcast_to(mx.array(logits)[None], (draws, 2, V))
    mx.random.seed(3)
    own, held = DeviceLoop.node_draws(loop, batch)
    assert 0 < np.array(held).mean() < 1  # both ways taken
    logprobs = batch - mx.logsumexp(batch, axis=-1, keepdims=True)
    tokens = np.array(mx.where(held, own, sample_token(logprobs, params.temperature, params.top_p)))  # (draws, 2)
    p = np.array(target_probs(mx.array(logits), params.temperature, params.top_p), dtype=np.float64)
    for node in range(2):
        order = np.argsort(-p[node])
        bins = np.array_split(order[p[node][order] > 0], 20)
        expected = np.array([p[node][b].sum() for b in bins]) / p[node].sum() * draws
        observed = np.array([np.isin(tokens[:, node], b).sum() for b in bins])
        assert observed.sum() == draws  # never a token outside the nucleus
        assert ((observed - expected) ** 2 / expected).sum() < chi_square_threshold(len(bins) - 1)


def test_a_step_s_fixed_cost_is_measured_kept_and_planned_with(tmp_path, monkeypatch):
    from mlx_specdec.drafting.step_cost import measure_step_overhead, step_overhead_for
    from mlx_specdec.decoding.redrafter_device import bucketed
    from mlx_specdec.drafting.verify_cost import cost_of, costs_at, shipped_table, worth_verifying

    monkeypatch.setenv("MLX_SPECDEC_HOME", str(tmp_path))
    lm = make_tiny_lm(seed=1, eos_id=96)
    head = random_head(lm, seed=1)
    assert measure_step_overhead(lm, head, 6, 2, 2, rounds=3) > 0
    assert step_overhead_for(lm, head, "h", 6, 2, 2, measure=False) is None  # nothing stored, nothing measured
    measured = step_overhead_for(lm, head, "h", 6, 2, 2, measure=True)
    assert measured > 0 and step_overhead_for(lm, head, "h", 6, 2, 2, measure=False) == pytest.approx(measured, abs=1e-4)

    plain, fixed = costs_at(150, bucketed(shipped_table())), costs_at(150, bucketed(shipped_table(), 2.0))
    assert [cost_of(fixed, t) - cost_of(plain, t) for t in (1, 3, 9)] == pytest.approx([2.0] * 3)
    # drafts each 0.9 likely: 4 query tokens are worth most per cost alone, but a step that pays
    # 2 forwards' worth whatever it verifies takes 8
    probs = np.full((1, 1, 8), 0.9)
    owner = np.zeros((1, 1, 9), dtype=np.int64)
    steep = CostTable(np.array([150.0]), np.array([[1.0 + 0.4 * t for t in range(8)]]), "steep")
    shallow = worth_verifying(probs, owner, 9, 150, table=bucketed(steep))
    deep = worth_verifying(probs, owner, 9, 150, table=bucketed(steep, 2.0))
    assert (shallow, deep) == (4, 8)


def test_on_a_gpu_auto_takes_the_device_step_and_writes_plain_decoding_s_answer(fake_cuda_gpu, monkeypatch):
    """With MLX's CUDA rules (a verify's keys read to a bucket under one mask), the default step
    is the device step; every row of a batch writes its greedy answer and one read a step."""
    from mlx_specdec.drafting import cost_probe

    monkeypatch.setenv(cost_probe.NO_FIRST_USE_ENV, "1")
    lm = make_tiny_lm(seed=3, eos_id=96)
    engine = engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))
    want = run(engine, PROMPTS[1], "ar", max_tokens=40)[0]
    got, stats = run(engine, PROMPTS[1], "redrafter", max_tokens=40)
    assert got == want and stats.extra["syncs_per_step"] == 1.0
    assert batch_answers(engine, PROMPTS, max_tokens=30) == [run(engine, p, "ar", max_tokens=30)[0] for p in PROMPTS]
