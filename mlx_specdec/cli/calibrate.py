"""`mlx-specdec calibrate`: measure what a multi-token verify costs on this machine (drafting/cost_probe.py)."""

from __future__ import annotations

import sys

from ..errors import UserError
from .args import _add_model_args, _comma_list, load_engine


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's verify cost for redrafter",
                       description="Time a forward of 1..T query tokens after a few context lengths on "
                                   "this machine and store the table in the user cache, where redrafter's "
                                   "--verify-cost rule reads it (it decides how many drafts a step verifies). "
                                   "Without one the CPU uses a table shipped from another machine and a GPU "
                                   "verifies every draft the cutoff keeps. Run it on a quiet machine; "
                                   "about a minute for the default model.")
    _add_model_args(p)
    p.add_argument("--contexts", default="150,2000,6000",
                   help="comma list of context lengths to measure after (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8, help="measure T = 1..this many query tokens (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=9,
                   help="timed forwards per T and context; the median counts (default: %(default)s)")
    p.add_argument("--show", action="store_true", help="print the table stored for this model and machine, measure nothing")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from ..drafting.cost_probe import load_table, measure_table, save_table, table_path

    contexts = _comma_list(args.contexts, int)
    if any(c < 1 for c in contexts) or contexts != sorted(set(contexts)):
        raise UserError("--contexts must be increasing positive token counts, e.g. 150,2000,6000")
    if args.tokens < 2 or args.rounds < 1:
        raise UserError("--tokens must be at least 2 and --rounds at least 1")
    args.drafter = "none"
    engine = load_engine(args)
    lm = engine.lm
    if args.show:
        table = load_table(lm)
        if table is None:
            raise UserError(f"no table measured for {lm.describe()} on this machine ({table_path(lm)}): "
                            "run `mlx-specdec calibrate`")
        print_table(table.contexts, table.costs, table.source)
        return 0
    limit = lm.context_length - args.tokens
    if contexts[-1] > limit:
        raise UserError(f"--contexts {contexts[-1]} does not fit {lm.name}'s {lm.context_length}-token window "
                        f"with {args.tokens} query tokens (at most {limit})")
    from tqdm import tqdm

    with tqdm(total=len(contexts) * args.rounds * args.tokens, desc="calibrate", unit="forward") as bar:
        table = measure_table(lm.model, contexts, args.tokens, args.rounds, progress=bar.update)
    path = save_table(lm, table, args.rounds)
    print_table(table.contexts, table.costs, f"{lm.describe()}, median of {args.rounds}")
    print(f"wrote {path}: redrafter uses it on this machine from now on", file=sys.stderr)
    return 0


def print_table(contexts, costs, source: str) -> None:
    """Markdown: one row per context, a T-token forward as a multiple of a one-token one."""
    print(f"verify cost (a T-token forward / a one-token forward), {source}")
    print("| context | " + " | ".join(f"T={t}" for t in range(1, costs.shape[1] + 1)) + " |")
    print("|---:|" + "---:|" * costs.shape[1])
    for context, row in zip(contexts, costs):
        print(f"| {int(context)} | " + " | ".join(f"{c:.2f}" for c in row) + " |")
