"""Pipeline-parallel decoding over real `mx.distributed` ranks (2 local ranks started by
`mlx.launch`, ring backend over the loopback): pp-ar, pp-spec and pipeinfer against
single-process `ar`, forced rejections and cancellations with a scripted drafter, the stages'
caches after cancellations, and the errors a user can cause. Every launch has a timeout."""

import os
import signal
import subprocess
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_specdec.distributed.split import plan_split
from mlx_specdec.errors import UserError

from conftest import save_tiny_model_dir

PROMPT = [(i * 7) % 50 + 3 for i in range(40)] + [(i * 13) % 40 + 5 for i in range(30)] + \
         [(i * 7) % 50 + 3 for i in range(12)]


def test_layers_split_evenly_or_as_told_and_bad_splits_are_one_line():
    assert [list(r) for r in plan_split(5, 2)] == [[0, 1], [2, 3, 4]]
    assert [list(r) for r in plan_split(30, 4, "6,8,8,8")][0] == list(range(6))
    for args, words in [((2, 3), "3 ranks for a model of 2 layers"), ((4, 2, "1,2"), "adds up to 3"),
                        ((4, 2, "1,2,1"), "3 layer counts for 2 ranks"), ((4, 2, "a,b"), "comma-separated"),
                        ((4, 2, "0,4"), "at least one layer"), ((4, 1), "at least 2 ranks")]:
        with pytest.raises(UserError, match=words):
            plan_split(*args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama on disk (4 layers, embeddings at their init scale so the argmax depends on
    the whole context: a cache that lost or kept a wrong entry changes the output) and its ar."""
    from mlx_specdec.decoding import GenerationParams
    from mlx_specdec.engine import Engine
    from mlx_specdec.model.loader import load_model

    path = tmp_path_factory.mktemp("tiny") / "model"
    save_tiny_model_dir(path, seed=4)
    weights = mx.load(str(path / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] / 8  # back to init scale
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    lm = load_model(str(path))
    params = GenerationParams(max_tokens=40)
    events = list(Engine(lm).generate_ids(PROMPT, "ar", params))
    want = [t for e in events if e.kind == "token" for t in e.tokens]
    return SimpleNamespace(path=str(path), lm=lm, want=want)


def run(tiny, jobs, drafter, timeout=120, **job):
    from mlx_specdec.distributed.launch import run_pipeline

    job = dict(model=str(tiny.path), jobs=jobs, drafter=drafter, timeout=30, **job)
    events = run_pipeline(job, ranks=2, timeout=timeout)
    out = {}
    for e in events:
        if "tokens" in e:
            out.setdefault(e["job"], []).extend(e["tokens"])
        if "stats" in e:
            out[("stats", e["job"])] = e["stats"]
    return out, events


def settings(method, **kw):
    return dict(method=method, max_tokens=40, check_cache=True, **kw)


def reference_checksums(tiny, committed):
    """Every stage's cache checksum over the canonical text, computed in one process."""
    from mlx_specdec.cache import ContiguousKVCache
    from mlx_specdec.distributed.stage import cache_checksum
    from mlx_specdec.model.forward import forward

    text = PROMPT + committed
    cache = ContiguousKVCache.for_model(tiny.lm.model)
    forward(tiny.lm.model, mx.array([text[:-1]]), cache, logits_for="none")
    spans = plan_split(len(tiny.lm.model.model.layers), 2)
    return [cache_checksum(SimpleNamespace(layers=cache.layers[s.start:s.stop]), len(text) - 1) for s in spans]


def close(a, b):
    return all(abs(x - y) <= 1e-4 * max(abs(y), 1) for x, y in zip(a, b))


def test_every_pipeline_method_writes_ar_s_tokens_and_forced_rejections_cancel_runs(tiny):
    scripted = dict(kind="scripted", continuation=tiny.want, wrong_at=[3, 4, 11, 20, 27])
    jobs = [dict(prompt=PROMPT, settings=settings("pp-ar")),
            dict(prompt=PROMPT, settings=settings("pp-spec", draft_length=4)),
            dict(prompt=PROMPT, settings=settings("pipeinfer", micro_batch=2, max_runs=4)),
            dict(prompt=PROMPT, settings=settings("pipeinfer", micro_batch=1, max_runs=3, prefill_chunk=16))]
    out, events = run(tiny, jobs, scripted)
    for job in range(len(jobs)):
        assert out[job] == tiny.want, job
        stats = out[("stats", job)]
        assert close(stats["cache_checksums"], reference_checksums(tiny, stats["committed"])), job
    assert out[("stats", 0)]["drafted"] == 0 and out[("stats", 0)]["decode_runs"] == len(tiny.want) - 1
    spec, infer = out[("stats", 1)], out[("stats", 2)]
    assert spec["rejected_drafts"] >= 4 and spec["cancelled"] == 0  # one run in flight: nothing to cancel
    assert infer["rejected_drafts"] >= 4 and infer["cancelled"] >= 4  # runs after a wrong draft
    assert len(tiny.want) >= 30
    assert infer["accepted"] >= len(tiny.want) // 2
    ranks = events[0]
    assert ranks["ranks"] == 2 and ranks["split"] == [[0, 1], [1, 2]] and len(ranks["parameter_mb"]) == 2


def test_every_pipeline_method_writes_ar_s_tokens_with_penalties(tiny):
    """Greedy with penalties: the rows come back as logits, each position is penalized by its own
    text at the head, and every method writes what `ar` writes with the same penalties in one
    process, whatever the drafts (scripted, some wrong)."""
    from mlx_specdec.decoding import GenerationParams
    from mlx_specdec.engine import Engine

    fields = dict(repetition_penalty=1.6, repetition_context_size=8, frequency_penalty=0.5, presence_penalty=0.3)
    events = list(Engine(tiny.lm).generate_ids(PROMPT, "ar", GenerationParams(max_tokens=40, **fields)))
    want = [t for e in events if e.kind == "token" for t in e.tokens]
    assert want != tiny.want  # the penalties change the answer
    scripted = dict(kind="scripted", continuation=want, wrong_at=[3, 11, 20])
    jobs = [dict(prompt=PROMPT, settings=settings("pp-ar", **fields)),
            dict(prompt=PROMPT, settings=settings("pp-spec", draft_length=4, **fields)),
            dict(prompt=PROMPT, settings=settings("pipeinfer", micro_batch=2, max_runs=4, **fields))]
    out, _ = run(tiny, jobs, scripted)
    for job in range(len(jobs)):
        assert out[job] == want, job
    assert out[("stats", 2)]["accepted"] >= len(want) // 2  # drafts were accepted: their positions penalized


def test_sampled_pipeinfer_tokens_are_the_targets_own_samples(tiny):
    """T = 0.1: the second token, after the likeliest first one, is distributed as the target's
    p(. | prompt, first), whatever the drafts (scripted: the target's greedy chain)."""
    import numpy as np

    from mlx_specdec.acceptance import target_probs
    from mlx_specdec.model.forward import forward

    from test_triforce import chi_square_below_critical

    temperature = 0.1  # the first token is one token 87% of the time; the second spreads over ~9
    jobs = [dict(prompt=PROMPT, settings=dict(method="pipeinfer", max_tokens=2, temperature=temperature,
                                              seed=seed, micro_batch=2, max_runs=2)) for seed in range(500)]
    out, _ = run(tiny, jobs, dict(kind="scripted", continuation=tiny.want), timeout=300)
    pairs = [out[j] for j in range(len(jobs))]
    first = max(set(p[0] for p in pairs), key=[p[0] for p in pairs].count)
    seconds = [p[1] for p in pairs if p[0] == first]
    assert len(seconds) >= 350
    logits = forward(tiny.lm.model, mx.array([PROMPT + [first]]), None, logits_for="last").logits[0, -1]
    p = np.array(target_probs(logits, temperature))
    ok, figures = chi_square_below_critical(seconds, p)
    assert ok, figures


def _rank_pids(rank: int):
    """The processes of pipeline rank `rank`: their command line and environment from /proc on
    Linux, from `ps -E` (which appends each process's environment to its command line) on macOS."""
    if not os.path.isdir("/proc"):
        listing = subprocess.run(["ps", "-A", "-E", "-ww", "-o", "pid=,command="], capture_output=True, text=True)
        if listing.returncode != 0:
            pytest.skip("neither /proc nor `ps -E` here: the ranks' processes cannot be found")
        return [int(line.split(None, 1)[0]) for line in listing.stdout.splitlines()
                if "distributed/rank.py" in line and f" MLX_RANK={rank} " in line + " "]
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")
            environ = open(f"/proc/{entry}/environ", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if "distributed/rank.py" in cmdline and f"MLX_RANK={rank}\0" in environ + "\0":
            pids.append(int(entry))
    return pids


@pytest.mark.parametrize("fault,words", [(signal.SIGKILL, "rank 1 is gone"), (signal.SIGSTOP, "rank 1 sent nothing")])
def test_a_rank_that_dies_or_hangs_ends_the_run_in_seconds_with_one_line_and_no_rank_left(tiny, fault, words):
    from mlx_specdec.distributed.launch import run_pipeline

    struck = []

    def strike(event):
        if "tokens" in event and not struck:
            for pid in _rank_pids(1):
                os.kill(pid, fault)
                struck.append(pid)

    job = dict(model=str(tiny.path), drafter=dict(kind="ngram"), timeout=3,
               jobs=[dict(prompt=PROMPT, settings=dict(method="pipeinfer", max_tokens=100000))] * 50)
    began = time.monotonic()
    with pytest.raises(UserError, match=words):
        run_pipeline(job, ranks=2, timeout=120, on_event=strike)
    assert struck and time.monotonic() - began < 60
    time.sleep(0.5)
    assert _rank_pids(0) == [] and _rank_pids(1) == []


@pytest.mark.parametrize("second,words,freeze", [
    ({"ssh": "127.0.0.1", "ips": ["192.0.2.1"]}, "rank 1: cannot join the ring", False),  # not this host's address
    ({"ssh": "192.0.2.1", "ips": ["192.0.2.1"]}, "rank 1 exited with code 255|did not connect", False),  # ssh fails
    ({"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, "did not connect within 8 s", True),  # rank 1 hangs before joining
])
def test_ranks_that_cannot_connect_end_in_seconds_with_one_line_and_no_rank_left(tiny, tmp_path, second, words, freeze):
    """A hostfile whose second host is not where it says (192.0.2.1: TEST-NET-1, RFC 5737, no
    machine has it), or a rank stopped before it joins the ring: the run ends with one line within
    the connect deadline, not the run's timeout."""
    import json
    import threading
    from mlx_specdec.distributed.launch import run_pipeline

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, second]))
    job = dict(model=str(tiny.path), drafter=dict(kind="none"), timeout=20,
               jobs=[dict(prompt=PROMPT, settings=dict(method="pp-ar", max_tokens=4))])
    frozen = []

    def freeze_rank_1():  # SIGSTOP rank 1 as soon as it exists: Python is still starting, far from init
        deadline = time.monotonic() + 20
        while not frozen and time.monotonic() < deadline:
            for pid in _rank_pids(1):
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
            time.sleep(0.005)

    if freeze:
        threading.Thread(target=freeze_rank_1, daemon=True).start()
    began = time.monotonic()
    with pytest.raises(UserError, match=words) as caught:
        run_pipeline(job, hostfile=str(hostfile), timeout=300, connect_timeout=8)
    assert frozen or not freeze
    assert time.monotonic() - began < 40 and "\n" not in str(caught.value)
    time.sleep(0.5)
    assert _rank_pids(0) == [] and _rank_pids(1) == []


def test_a_rank_with_another_model_is_one_line(tiny, tmp_path):
    from mlx_specdec.distributed.launch import run_pipeline

    other = save_tiny_model_dir(tmp_path / "other", seed=9)
    job = dict(model=str(tiny.path), model_by_rank={"1": str(other)}, drafter=dict(kind="none"), timeout=20,
               jobs=[dict(prompt=PROMPT, settings=dict(method="pp-ar", max_tokens=4))])
    with pytest.raises(UserError, match="rank 1 loaded a different model than rank 0"):
        run_pipeline(job, ranks=2, timeout=120)


def test_cli_generate_over_ranks_writes_ar_s_answer_and_bad_input_is_one_line(tiny, tmp_path):
    import sys

    cli = [sys.executable, "-m", "mlx_specdec.cli"]
    base = ["generate", "-m", tiny.path, "-p", "w3 w5 w7 w9 w3 w5 w7", "--raw", "--max-tokens", "12", "--temp", "0"]
    want = subprocess.run(cli + base, capture_output=True, text=True, timeout=120)
    assert want.returncode == 0, want.stderr
    for method in ("pp-ar", "pp-spec", "pipeinfer"):
        got = subprocess.run(cli + base + ["--method", method, "--ranks", "2"], capture_output=True, text=True,
                             timeout=120)
        assert got.returncode == 0, got.stderr
        assert got.stdout == want.stdout, method
        assert f"[{method} over 2 ranks]" in got.stderr
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text("not json")
    for extra, words in [(["--ranks", "3"], "3 ranks for a model of 2 layers"),
                         (["--ranks", "2", "--split", "1,2"], "adds up to 3 layers"),
                         (["--ranks", "1"], "at least 2"),
                         (["--hostfile", str(hostfile)], "not JSON"),
                         (["--hostfile", str(tmp_path / "none.json")], "no such file"),
                         (["--ranks", "2", "--method", "redrafter"], "--ranks runs pp-ar")]:
        bad = subprocess.run(cli + base + extra, capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and words in bad.stderr and "Traceback" not in bad.stderr, (extra, bad.stderr)
        said = [line for line in bad.stderr.strip().splitlines() if not line.startswith("sampling: ")]
        assert len(said) == 1, bad.stderr  # one error line (beside the sampling in force)


def test_cli_bench_compares_pipeline_methods_with_ar_and_reports_identical_output(tiny, tmp_path):
    """In the main bench's schema, in the format asked: JSON to stdout, CSV to --output."""
    import csv
    import json
    import sys

    from mlx_specdec.bench import ROW_COLUMNS

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w5 w7 w9 w3 w5 w7\nw11 w13 w11 w13 w11\n")
    cli = [sys.executable, "-m", "mlx_specdec.cli", "bench", "-m", tiny.path, "--prompts", str(prompts),
           "--methods", "ar,pp-ar,pp-spec,pipeinfer", "--ranks", "2", "--max-tokens", "10", "--pp-drafter", "ngram"]
    done = subprocess.run(cli + ["--format", "json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) == {"environment", "params", "rows", "summary", "per_category"}
    assert report["environment"]["ranks"] == 2 and len(report["environment"]["parameter_mb"]) == 2
    summary = {s["method"]: s for s in report["summary"]}
    assert set(summary) == {"ar", "pp-ar", "pp-spec", "pipeinfer"}
    assert all(s["identical_fraction"] == 1.0 and s["decode_tps"] > 0 for s in summary.values())
    assert summary["pipeinfer"]["runs"] >= summary["pipeinfer"]["speculative_runs"] >= summary["pipeinfer"]["cancelled"]
    assert len(summary["pp-spec"]["stage_idle"]) == 2 and summary["pp-spec"]["speedup_vs_pp_spec"] == 1.0
    out = tmp_path / "bench.csv"
    done = subprocess.run(cli + ["--format", "csv", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "", done.stderr
    table = csv.DictReader(out.read_text().splitlines())
    rows = list(table)
    assert table.fieldnames == ROW_COLUMNS and len(rows) == 4 * 2
    assert all(r["identical_to_ar"] == "True" and int(r["new_tokens"]) > 0 for r in rows)
    bad = subprocess.run([sys.executable, "-m", "mlx_specdec.cli", "bench", "-m", tiny.path, "--prompts", str(prompts),
                          "--methods", "ar,redrafter,pipeinfer", "--ranks", "2"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "not redrafter" in bad.stderr


def test_an_event_line_with_the_launcher_s_warning_on_its_end_is_still_read():
    """mlx.launch and the ranks share one pipe: a warning can land on the end of an event's line."""
    from mlx_specdec.distributed.launch import _event

    line = '{"tokens": [19], "job": 0}\x1b[33m[WARN] Node with rank 0 exited with code 1 \x1b[0m\n'
    event, rest = _event(line)
    assert event == {"tokens": [19], "job": 0} and "Node with rank 0 exited with code 1" in rest
    assert _event('{"done": true}\n') == ({"done": True}, "")
    assert _event('{"tokens": [1')[0] is None  # torn: not an event


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_models_run_over_ranks_writing_ar_s_answer(tmp_path, model_type):
    """Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms): each stage runs the one block with its
    architecture's switches; every pipeline method's greedy answer is single-process ar's."""
    import sys

    from qwen_helpers import write_qwen_dir

    path = write_qwen_dir(tmp_path / model_type, model_type, seed=8)
    cli = [sys.executable, "-m", "mlx_specdec.cli"]
    base = ["generate", "-m", str(path), "-p", "Why is the sky blue? Why is the sky blue?", "--max-tokens", "12",
            "--temp", "0"]
    want = subprocess.run(cli + base, capture_output=True, text=True, timeout=120)
    assert want.returncode == 0 and want.stdout.strip(), want.stderr
    for method in ("pp-ar", "pipeinfer"):
        got = subprocess.run(cli + base + ["--method", method, "--ranks", "2"], capture_output=True, text=True,
                             timeout=120)
        assert got.returncode == 0, got.stderr
        assert got.stdout == want.stdout, method
