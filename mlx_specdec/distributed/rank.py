"""One pipeline rank: the program `mlx.launch` starts on every rank (`launch.py` starts it).

    python rank.py JOB.json

The job names the model, the split, the drafter, the emulated link, and the generations to run
(prompt ids, method, settings). Every rank loads the model, keeps only its layers, and serves;
rank 0 (the head) runs the generations and prints one `@@mlx-specdec {json}` line per event on
stdout for the launcher: the ranks' fingerprints and memory, tokens, stats, or one error line.

Threads: with `pin` (local ranks only: launch.py turns it off for a hostfile, where every rank
has a machine of its own) each rank runs on one core of its own (`os.sched_setaffinity`, rank r on
core r mod cores) with one BLAS thread, set before MLX loads, so that ranks sharing a machine with
few cores share it fairly instead of their BLAS threads fighting for the cores. Where the system
cannot pin a process (macOS has no `sched_setaffinity`) nothing is changed.
"""

from __future__ import annotations

import json
import os
import sys

MARK = "@@mlx-specdec "


def can_pin() -> bool:
    """Whether this system can move a process to one core (Linux; not macOS)."""
    return hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")


def _pin(rank: int) -> None:
    """Before BLAS loads (it reads its thread count once). A system that cannot pin keeps its
    threads as they are: one BLAS thread on a core shared with everything else would only be slower."""
    if not can_pin():
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def quiet_ring_threads(before: set) -> None:
    """The ring backend's socket threads (the ones `mx.distributed.init` starts) retry a
    non-blocking recv in a loop while a receive is posted: a rank waiting in recv keeps a core
    busy, and with a receive always posted the ranks' layers run much slower on a machine with few
    cores. SCHED_IDLE (Linux) lets them spin only on a core nothing else wants; on other systems
    nothing changes."""
    if not before or not (hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")):
        return
    for tid in set(os.listdir("/proc/self/task")) - before:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def emit(event: dict) -> None:
    print(MARK + json.dumps(event), flush=True)


def make_drafter(spec: dict, lm, engine_drafter=None):
    from .drafters import HeadDrafter, NgramDrafter, ScriptedDrafter

    kind = spec.get("kind", "auto")
    vocab = lm.model.model.embed_tokens.weight.shape[0]
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(vocab, int(spec.get("length", 8)))
    if kind == "scripted":
        return ScriptedDrafter(spec["continuation"], spec.get("wrong_at", ()), vocab)
    if kind in ("head", "auto"):
        from ..engine import Engine

        head = Engine(lm, drafter=spec.get("path") or "auto", apar_adapter=None).drafter
        if head is None and kind == "auto":
            return NgramDrafter(vocab, int(spec.get("length", 8)))
        if head is None:
            from ..errors import UserError

            raise UserError("--drafter head: no trained draft head for this model")
        return HeadDrafter(head, lm.model.model.embed_tokens, vocab, int(spec.get("length", 4)))
    raise ValueError(f"unknown drafter {kind!r}")


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    import mlx.core as mx

    threads = set(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else set()  # Linux only
    try:
        group = mx.distributed.init()
    except RuntimeError as error:  # e.g. "[ring] Couldn't bind socket": an address not on this host
        print(f"rank {os.environ.get('MLX_RANK', '?')}: cannot join the ring ({error}): is this host at the "
              "address the hostfile gives it?", file=sys.stderr, flush=True)
        os._exit(1)
    rank, ranks = group.rank(), group.size()
    if rank == 0:  # the launcher's connect deadline ends here (launch.py)
        emit({"connected": ranks})
    if job.get("quiet_ring", True):
        quiet_ring_threads(threads)
    from ..errors import UserError
    from ..model.loader import load_model
    from .coordinator import Head, PipelineSettings
    from .link import Outbox, RankFailure
    from .split import plan_split
    from .stage import StageModel, serve_stage

    timeout = float(job.get("timeout", 60))
    link = job.get("link", {})
    try:
        # a host whose copy of the model lives elsewhere (tests use it to give one rank another model)
        lm = load_model(job.get("model_by_rank", {}).get(str(rank), job["model"]), job.get("dtype", "auto"))
        spans = plan_split(len(lm.model.model.layers), ranks, job.get("split"))
        drafter = make_drafter(job.get("drafter", {}), lm) if rank == 0 else None
        eos = sorted(getattr(lm.tokenizer, "eos_token_ids", None) or [lm.tokenizer.eos_token_id])
        stage = StageModel(lm.model, spans[rank])
    except Exception as error:  # noqa: BLE001
        line = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
        if rank == 0:
            emit({"error": f"rank 0: {line}"})
        else:
            print(f"rank {rank}: {line}", file=sys.stderr, flush=True)
        os._exit(1)
    if rank != 0:
        try:
            serve_stage(stage, group, rank, ranks, idle_timeout=float(job.get("idle_timeout", 600)),
                        latency_ms=float(link.get("latency_ms", 0)), gbps=float(link.get("gbps", 0)))
        except Exception as error:  # noqa: BLE001  (the head reports it; this rank just ends)
            print(f"rank {rank}: {error}", file=sys.stderr, flush=True)
            os._exit(1)
        os._exit(0)

    outbox = Outbox(group, 1, float(link.get("latency_ms", 0)), float(link.get("gbps", 0)))
    head = Head(stage, group, ranks, outbox, drafter)
    try:
        prints = head.handshake(timeout)
        mine = stage.fingerprint
        for other, values in enumerate(prints, start=1):
            if values[:4] != mine:
                raise RankFailure(f"rank {other} loaded a different model than rank 0 (layers, width, vocabulary, "
                                  f"checksum {values[:4]} vs {mine}): give every rank the same model")
        emit({"ranks": ranks, "split": [[s.start, s.stop] for s in spans],
              "parameter_mb": [round(stage.parameter_bytes() / 2 ** 20, 1)] + [round(v[4] / 1024, 1) for v in prints]})
        for index, item in enumerate(job["jobs"]):
            settings = PipelineSettings(**item.get("settings", {}), eos=eos, timeout=timeout)
            if job.get("drafter", {}).get("kind") == "scripted" and "continuation" in item:
                head.drafter = make_drafter(dict(job["drafter"], **item), lm)
            for event in head.generate(list(item["prompt"]), settings):
                emit(dict(event, job=index))
        head.stop()
    except Exception as error:  # noqa: BLE001
        line = str(error) if isinstance(error, (RankFailure, UserError)) else f"{type(error).__name__}: {error}"
        emit({"error": line})
        os._exit(1)
    emit({"done": True})
    os._exit(0)


if __name__ == "__main__":
    with open(sys.argv[1]) as job_file:
        if json.load(job_file).get("pin", True):
            _pin(int(os.environ.get("MLX_RANK", "0")))  # mlx.launch names the rank in the environment
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from mlx_specdec.distributed.rank import main as package_main

    package_main(sys.argv[1])
