"""`mlx-specdec bench`: run every method on the same prompts and compare with plain decoding."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import UserError
from ..synthetic_shapes import add_synthetic_args
from .args import METHODS_HELP, _add_method_args, _add_model_args, _comma_list, _parse, load_engine, method_grids
from .pipeline import PIPELINE_METHODS, add_pipeline_args


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="compare methods on a prompt set",
                       description="Run every method on the same prompts and compare with plain "
                                   "decoding (ar): speed-up, tokens per forward, identical output.")
    _add_model_args(p)
    p.add_argument("--methods", default="ar,mlx-lm",
                   help=f"comma list of methods: {METHODS_HELP} (default: %(default)s)")
    _add_method_args(p, lists=True)
    p.add_argument("--prompts", default=None,
                   help="FastChat question file (JSON lines) or text file, one prompt a line "
                        "(default: benchmarks/prompts.jsonl)")
    p.add_argument("--categories", default=None, help="comma list of categories to keep")
    p.add_argument("--shapes", default=None,
                   help="comma list of answer shapes to keep (list, paragraphs, code, math); with "
                        "--categories, a prompt is kept if it matches either")
    p.add_argument("--context-length", default=None, metavar="SIZE",
                   help="long documents: the prompts of one size from benchmarks/long_prompts.jsonl (or "
                        "--prompts): 2k (1800-2048 tokens), 4k (3600-4096), 6k (6000-7000), all, or a "
                        "number of tokens (the nearest set); question, summary and needle (pass key) "
                        "prompts, so --categories needle works. A prompt that does not fit the window "
                        "with --max-tokens is refused, not cut")
    p.add_argument("--ids", default=None, help="comma list of prompt ids to keep (e.g. 6k-question-1,6k-needle-50)")
    p.add_argument("--limit", type=int, default=None, help="use the first K prompts")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="repeat the whole run R times; the sd over repeats needs R >= 2, else it is n/a "
                        "(default: 1)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (default: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold when sampling (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    thinking = _thinking_setting()
    p.add_argument("--thinking", default=None, help=f"{thinking.help} ({thinking.bounds()})")
    p.add_argument("--format", default="md", help="md, json or csv (default: md)")
    p.add_argument("--output", "-o", default=None, help="write the report here (default: stdout)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="also draw decode tok/s and speed-up over ar per method and prompt category (matplotlib)")
    add_pipeline_args(p)
    add_synthetic_args(p)
    p.set_defaults(func=cmd_bench)


FORMATS = ("md", "json", "csv")


def cmd_bench(args) -> int:
    if args.synthetic:  # a random model of a named shape instead of prompts (bench_synthetic.py)
        from ..bench_synthetic_report import cmd_synthetic

        return cmd_synthetic(args)
    from ..bench import expand_configs, run_bench

    if args.format not in FORMATS:  # before any model loads or rank starts
        raise UserError(f"unknown format {args.format!r} (choose md, json or csv)")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"--plot writes .png, .svg or .pdf, not {args.plot!r}")
    methods = _comma_list(args.methods)
    if any(m in PIPELINE_METHODS for m in methods):
        return _bench_pipeline(args, methods)
    grids = method_grids(args)
    heads = _comma_list(args.drafter)
    if len(heads) > 1:  # several heads compared in one run: each a redrafter setting, the first loaded now
        grids.setdefault("redrafter", {})["drafter"] = heads
        args.drafter = heads[0]
    configs = expand_configs(methods, grids)
    prompts = _prompts(args)
    engine = load_engine(args)
    for head in heads[1:]:  # a missing or mismatched head stops the bench before it runs, not midway
        engine.drafter_for(head)
    costs = engine.verify_costs if "redrafter" in methods else None
    if costs is not None and costs.source.startswith("shipped"):
        print("note: redrafter judges its drafts by the verify costs shipped for a 2-core x86 VM; "
              "`mlx-specdec calibrate` (about a minute) measures this machine's", file=sys.stderr)
    params = _params(args)
    return _report(args, run_bench(engine, prompts, configs, params, repeats=args.repeats))


def _bench_pipeline(args, methods) -> int:
    """pp-ar, pp-spec, pipeinfer over ranks, against ar in this process (bench_pipeline.py)."""
    from ..bench_pipeline import run_pipeline_bench

    other = [m for m in methods if m not in PIPELINE_METHODS + ("ar",)]
    if other:
        raise UserError(f"a pipeline bench compares ar, {', '.join(PIPELINE_METHODS)}; not {', '.join(other)}")
    if args.ranks is None and args.hostfile is None:
        args.ranks = 2
    prompts = _prompts(args)
    engine = load_engine(args)
    params = _params(args)
    return _report(args, run_pipeline_bench(args, engine, prompts, methods, params, repeats=args.repeats))


def _thinking_setting():
    from ..settings import SAMPLING

    return next(s for s in SAMPLING if s.name == "thinking")


def _params(args):
    """The bench's sampling (greedy unless asked) and the template's thinking switch."""
    from ..decoding import GenerationParams

    thinking = None if args.thinking is None else _parse(_thinking_setting(), args.thinking)
    return GenerationParams(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, seed=args.seed,
                            thinking=thinking)


def _prompts(args):
    from ..bench import load_prompts

    return load_prompts(args.prompts, limit=args.limit,
                        categories=_comma_list(args.categories) if args.categories else None,
                        shapes=_comma_list(args.shapes) if args.shapes else None,
                        context=args.context_length, ids=_comma_list(args.ids) if args.ids else None)


def _report(args, result: dict) -> int:
    """The report in the format asked, to --output (the summary to stderr) or to stdout; the plot."""
    from ..bench_report import plot_bench, print_summary, render

    text = render(result, args.format)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        print_summary(result)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.plot:
        print(f"wrote {plot_bench(result, Path(args.plot))}", file=sys.stderr)
    return 0
