"""`--ranks N` / `--hostfile FILE`: run a pipeline method (pp-ar, pp-spec, pipeinfer) over ranks
that `mlx.launch` starts (distributed/launch.py). The options every pipeline command shares."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional

from ..distributed import METHODS as PIPELINE_METHODS
from ..errors import UserError
from .args import expert_argument


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline (pp-ar, pp-spec, pipeinfer: the model split across ranks)")
    g.add_argument("--ranks", type=int, default=None,
                   help="start N local ranks (processes) with mlx.launch, each holding a slice of the layers")
    g.add_argument("--hostfile", default=None,
                   help="an mlx.launch hostfile (JSON): one rank per Mac, over Ethernet or Thunderbolt (docs/pipeinfer.md)")
    expert = [
        (("--split",), dict(default=None), "layers per rank, comma-separated (e.g. 14,16); default: even, "
         "leftovers on the last ranks"),
        (("--pp-drafter",), dict(default="auto", choices=["auto", "ngram", "head", "none"]),
         "the first rank's drafts: head (the ReDrafter head), ngram (prompt lookup) or none; auto = the head "
         "where the model has one, else ngram (default: auto)"),
        (("--pp-draft-length",), dict(type=int, default=4), "pp-spec: drafts per verify (default: 4)"),
        (("--micro-batch",), dict(type=int, default=2), "pipeinfer: tokens per speculative run, 1-16 (default: 2)"),
        (("--max-runs",), dict(type=int, default=1),
         "pipeinfer: speculative runs in flight besides the known token's (default: 1)"),
        (("--p-accept",), dict(type=float, default=0.4),
         "pipeinfer: confidence cutoff; a draft below it is not sent (the head's own probability; n-gram "
         "drafts: their running acceptance) (default: 0.4)"),
        (("--p-recovery",), dict(type=float, default=0.0),
         "pipeinfer: cutoff += this per run launched while waiting (default: 0)"),
        (("--p-decay",), dict(type=float, default=0.0),
         "pipeinfer: cutoff -= this per draft attempt that found nothing (default: 0)"),
        (("--link-latency-ms",), dict(type=float, default=0.0),
         "add this delay to every message between ranks (stands in for a network; default: 0)"),
        (("--link-gbps",), dict(type=float, default=0.0),
         "and carry messages at this bandwidth (Gbit/s; 0 = as fast as the loopback)"),
        (("--rank-timeout",), dict(type=float, default=60.0),
         "seconds a rank may stay silent before the run ends with one line (default: 60)"),
    ]
    for flags, kwargs, text in expert:
        expert_argument(p, *flags, help=f"pipeline: {text}", **kwargs)


def check_pipeline_args(args) -> None:
    if args.ranks is not None and args.ranks < 2:
        raise UserError(f"--ranks needs at least 2, not {args.ranks}")
    if not 1 <= args.micro_batch <= 16 or args.max_runs < 1 or args.pp_draft_length < 1:
        raise UserError("--micro-batch is 1-16, --max-runs and --pp-draft-length at least 1")
    if args.link_latency_ms < 0 or args.link_gbps < 0 or args.rank_timeout <= 0:
        raise UserError("--link-latency-ms and --link-gbps are >= 0, --rank-timeout > 0")


def pipeline_job(args, model_path: str, jobs: List[dict]) -> dict:
    return dict(model=model_path, dtype=args.dtype, split=args.split, jobs=jobs, timeout=args.rank_timeout,
                drafter=dict(kind=args.pp_drafter, length=max(args.micro_batch * args.max_runs, args.pp_draft_length)),
                link=dict(latency_ms=args.link_latency_ms, gbps=args.link_gbps))


def pipeline_settings(args, method: str, max_tokens: int) -> dict:
    return dict(method=method, max_tokens=max_tokens, temperature=args.temp, top_p=getattr(args, "top_p", 1.0),
                **getattr(args, "penalties", {}), seed=args.seed, draft_length=args.pp_draft_length, micro_batch=args.micro_batch,
                max_runs=args.max_runs, p_accept=args.p_accept, p_recovery=args.p_recovery, p_decay=args.p_decay)


def run_jobs(args, model_path: str, jobs: List[dict], on_event: Optional[Callable[[dict], None]] = None,
             timeout: float = 3600.0) -> List[dict]:
    from ..distributed.launch import run_pipeline

    check_pipeline_args(args)
    _check_layers(model_path, args)
    return run_pipeline(pipeline_job(args, model_path, jobs), ranks=args.ranks or 2, hostfile=args.hostfile,
                        timeout=timeout, on_event=on_event)


def _check_layers(model_path: str, args) -> None:
    """More ranks than layers, or a split that does not add up: one line before any rank starts."""
    import json
    from pathlib import Path

    from ..distributed.launch import check_hostfile
    from ..distributed.split import plan_split

    config = Path(model_path) / "config.json"
    layers = json.loads(config.read_text()).get("num_hidden_layers") if config.exists() else None
    if layers:
        plan_split(int(layers), check_hostfile(args.hostfile) if args.hostfile else (args.ranks or 2), args.split)


def generate_pipelined(args, prompt: str) -> int:
    """`generate --ranks N`: the answer streams from the head; the stats line goes to stderr."""
    from ..model.loader import load_tokenizer_only

    method = args.method if args.method in PIPELINE_METHODS else "pipeinfer"
    text_side = load_tokenizer_only(args.model)  # the weights load on the ranks
    path = text_side.path
    ids = text_side.encode_prompt(prompt, chat=not args.raw)
    detok = text_side.tokenizer.detokenizer
    eos = text_side.eos_token_ids
    detok.reset()

    def show(event: dict) -> None:
        if "tokens" in event:
            for token in event["tokens"]:
                if token not in eos:  # the answer's text ends before its EOS, as in-process generation
                    detok.add_token(token)
            sys.stdout.write(detok.last_segment)
            sys.stdout.flush()
        elif "stats" in event:
            detok.finalize()
            sys.stdout.write(detok.last_segment + "\n")
            s = event["stats"]
            rate = max(s["new_tokens"] - 1, 0) / s["decode_s"]
            print(f"[{method} over {args.ranks or 'hostfile'} ranks] {s['new_tokens']} tokens, {rate:.2f} tok/s, "
                  f"TTFT {s['ttft_s'] * 1000:.0f} ms, {s['tokens_per_pass']} tokens/pass, runs {s['runs']} "
                  f"(cancelled {s['cancelled']}), stage idle {s['stage_idle']}", file=sys.stderr)
        elif "parameter_mb" in event:
            print(f"[ranks] layers {event['split']}, parameters MB per rank {event['parameter_mb']}", file=sys.stderr)

    run_jobs(args, str(path), [dict(prompt=ids, settings=pipeline_settings(args, method, args.max_tokens))], show)
    return 0
