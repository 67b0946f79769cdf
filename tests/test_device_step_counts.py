"""The device step's host traffic counted through MLX and numpy themselves (tests/mlx_counts.py):
every eval and read of pending work, every array built from host data, whoever makes it, and
every distinct shape its compiled parts see. Greedy and sampled, with and without penalties, with
prompt lookup, and a batch with holes; the answers stay plain decoding's where greedy."""

import importlib

import pytest

from mlx_specdec.decoding import STRATEGIES, redrafter_device
from mlx_specdec.decoding.redrafter_device import DeviceLoop

from conftest import make_tiny_lm
from mlx_counts import count_steps, counting
from test_redrafter import PROMPTS, engine_with, oracle_head, run, run_batch

forward_module = importlib.import_module("mlx_specdec.model.forward")
SAMPLED = dict(temperature=0.7, top_p=0.9, seed=1)
PENALTY = dict(repetition_penalty=1.1)
CASES = {"greedy": {}, "greedy-penalty": PENALTY, "sampled": SAMPLED, "sampled-penalty": {**SAMPLED, **PENALTY},
         "greedy-all-penalties": dict(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.2)}


@pytest.fixture(scope="module")
def engine():
    lm = make_tiny_lm(seed=3, eos_id=96)
    return engine_with(lm, oracle_head(lm, PROMPTS, corrupt=0.3))


def shapes_seen(patch) -> set:
    """Every distinct input shape of the step's compiled accept and of the verify's forward."""
    seen = set()
    accept, forward = redrafter_device._accept, forward_module.forward

    def counted_accept(*arrays):
        seen.add(("accept",) + tuple(tuple(a.shape) for a in arrays))
        return accept(*arrays)

    def counted_forward(model, tokens, cache, positions=None, mask=None, **kw):
        seen.add(("verify", tuple(tokens.shape), None if mask is None else tuple(mask.shape)))
        return forward(model, tokens, cache, positions=positions, mask=mask, **kw)

    patch.setattr(redrafter_device, "_accept", counted_accept)
    patch.setattr(forward_module, "forward", counted_forward)
    return seen


def counted(patch, answer):
    """answer() under the counters -> (its result, reads, built, steps, shapes)."""
    with counting(patch) as counter:
        steps = count_steps(patch, DeviceLoop, counter)
        shapes = shapes_seen(patch)
        result = answer()
    return result, counter.reads, counter.built, steps["steps"], shapes


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("lookup", [0, 4], ids=["head", "lookup-and-head"])
def test_one_read_and_one_host_array_a_step_counted_by_mlx(engine, case, lookup, monkeypatch):
    params = dict(max_tokens=48, options={"step": "device", "lookup": lookup}, **CASES[case])
    (tokens, stats), reads, built, steps, shapes = counted(
        monkeypatch, lambda: run(engine, PROMPTS[0], "redrafter", **params))
    assert steps >= 8, steps
    assert reads <= steps and built <= steps, (reads, built, steps)
    verifies = {s for s in shapes if s[0] == "verify"}
    accepts = {s for s in shapes if s[0] == "accept"}
    assert len(verifies) <= 4 and len(accepts) <= 4, shapes
    if "temperature" not in CASES[case]:
        penalties = {k: v for k, v in CASES[case].items()}
        assert tokens == run(engine, PROMPTS[0], "ar", max_tokens=48, **penalties)[0]


@pytest.mark.parametrize("case", ["greedy", "greedy-all-penalties", "sampled-penalty"])
def test_a_batch_with_holes_counted_by_mlx(engine, case, monkeypatch):
    params = dict(max_tokens=30, options={"step": "device"}, **CASES[case])
    (answers, _), reads, built, steps, _ = counted(monkeypatch, lambda: run_batch(engine, PROMPTS, **params))
    # A row leaving the batch (twice here) costs each device-side part its own index array: cache,
    # drafts, head, penalties and the holes' mask, at most 5; the steps themselves one each.
    assert reads <= steps and built <= steps + 2 * 5, (reads, built, steps)
    if "temperature" not in CASES[case]:
        assert answers == [run(engine, p, "ar", max_tokens=30, **CASES[case])[0] for p in PROMPTS]


def test_plain_decoding_reads_once_a_token_counted_by_mlx(engine, monkeypatch):
    with counting(monkeypatch) as counter:
        real = STRATEGIES["ar"]

        def counted_ar(ctx):
            counter.on = True
            try:
                yield from real(ctx)
            finally:
                counter.on = False

        monkeypatch.setitem(STRATEGIES, "ar", counted_ar)
        tokens, _ = run(engine, PROMPTS[0], "ar", max_tokens=40)
    # one read a token, and the prefill's and the first token's; one scalar built a token (the
    # forward's cache offset), the prompt's last token
    assert len(tokens) == 40
    assert counter.reads <= len(tokens) + 2 and counter.built <= len(tokens) + 4, (counter.reads, counter.built)


def test_the_counter_sees_reads_the_wrappers_do_not(engine, monkeypatch):
    """A read added to the step outside host_traffic's wrappers (an `.item()`) is counted."""
    real = DeviceLoop.adopt

    def adopt(self, drafts, own, values):
        int(drafts.beams[0, 0, 0].item())  # a stray read of pending work
        return real(self, drafts, own, values)

    monkeypatch.setattr(DeviceLoop, "adopt", adopt)
    params = dict(max_tokens=40, options={"step": "device", "lookup": 0})
    _, reads, _, steps, _ = counted(monkeypatch, lambda: run(engine, PROMPTS[0], "redrafter", **params))
    assert reads > steps
