"""`mlx-specdec calibrate`: measure what a multi-token verify costs on this machine (drafting/cost_probe.py)."""

from __future__ import annotations

import os
import sys

from ..errors import UserError
from ..model.device import on_cpu
from ..drafting.cost_probe import DEFAULT_ROUNDS
from .args import _add_model_args, _comma_list, load_engine


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's verify cost for redrafter",
                       description="Time a forward of 1..T query tokens after a few context lengths on "
                                   "this machine and store the table in the user cache, where redrafter's "
                                   "--verify-cost rule reads it (it decides how many drafts a step verifies). "
                                   "Without one the CPU uses a table shipped from another machine and a GPU "
                                   "measures a short one at first use. On the CPU it first times the "
                                   "float32 weights row- against column-major and keeps the faster (the table "
                                   "holds for that layout only). Run it on a quiet machine; about two minutes "
                                   "for the default model.")
    _add_model_args(p)
    p.add_argument("--contexts", default="150,2000,6000",
                   help="comma list of context lengths to measure after (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8, help="measure T = 1..this many query tokens (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help="timed forwards per T and context; the median of each T's ratio to the same round's "
                        "one-token forward counts (default: %(default)s)")
    p.add_argument("--layout-rounds", type=int, default=5,
                   help="interleaved rounds timing the CPU weight layouts first, row- against column-major "
                        "(0: keep the one chosen at load; default: %(default)s)")
    p.add_argument("--show", action="store_true", help="print the table stored for this model and machine, measure nothing")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from ..drafting.cost_probe import load_table, measure_table, save_table, table_path

    contexts = _comma_list(args.contexts, int)
    if any(c < 1 for c in contexts) or contexts != sorted(set(contexts)):
        raise UserError("--contexts must be increasing positive token counts, e.g. 150,2000,6000")
    if args.tokens < 2 or args.rounds < 1 or args.layout_rounds < 0:
        raise UserError("--tokens must be at least 2, --rounds at least 1 and --layout-rounds at least 0")
    args.drafter = "none"
    engine = load_engine(args)
    lm = engine.lm
    if args.show:
        print(f"weights: {lm.layout}")
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

    remeasure_layout(lm, args.layout_rounds)
    with tqdm(total=len(contexts) * args.rounds * args.tokens, desc="calibrate", unit="forward") as bar:
        table = measure_table(lm.model, contexts, args.tokens, args.rounds, progress=bar.update)
    path = save_table(lm, table, args.rounds)
    print_table(table.contexts, table.costs, f"{lm.describe()}, median of {args.rounds}")
    print(f"wrote {path}: redrafter uses it on this machine from now on", file=sys.stderr)
    measure_draft_step(engine)
    return 0


def measure_draft_step(engine) -> None:
    """The shipped head's draft step beside the table (drafting/step_cost.py), where there is one
    and the device step plans with it (off the CPU)."""
    from ..model.device import on_cpu

    if on_cpu():
        return
    from ..decoding.redrafter import DEFAULT_BEAM_LENGTH, DEFAULT_RUNNERS_UP, DEFAULT_RUNNERS_UP_DEPTHS
    from ..drafting.cost_probe import table_path
    from ..drafting.step_cost import measure_step_overhead, overhead_path, save_step_overhead

    head = engine.drafter_for("auto")
    if head is None:
        return
    value = measure_step_overhead(engine.lm, head, DEFAULT_BEAM_LENGTH, DEFAULT_RUNNERS_UP, DEFAULT_RUNNERS_UP_DEPTHS)
    path = overhead_path(table_path(engine.lm), "auto")
    save_step_overhead(path, value, DEFAULT_BEAM_LENGTH, DEFAULT_RUNNERS_UP)
    print(f"a draft step (the head's whole chain and its read) costs {value:.2f} one-token forwards here: {path}",
          file=sys.stderr)


def remeasure_layout(lm, rounds: int) -> None:
    """The CPU weight layout first (model/cpu_layout.py): the table is only valid for the layout it
    was measured in."""
    from ..model import cpu_layout

    if rounds == 0 or lm.dtype != "float32" or not on_cpu() or os.environ.get(cpu_layout.LAYOUT_ENV):
        print(f"weights: {lm.layout}", file=sys.stderr)
        return
    print(f"timing the weight layouts ({rounds} rounds) ...", file=sys.stderr)
    measured = cpu_layout.measure_layouts(lm.model, rounds)
    choice = cpu_layout.save_layout(lm.name, lm.dtype, measured, rounds)
    cpu_layout.store_layout(lm.model, choice.layout)
    lm.layout = choice.describe()
    print(f"weights: {lm.layout}", file=sys.stderr)


def print_table(contexts, costs, source: str) -> None:
    """Markdown: one row per context, a T-token forward as a multiple of a one-token one."""
    print(f"verify cost (a T-token forward / a one-token forward), {source}")
    print("| context | " + " | ".join(f"T={t}" for t in range(1, costs.shape[1] + 1)) + " |")
    print("|---:|" + "---:|" * costs.shape[1])
    for context, row in zip(contexts, costs):
        print(f"| {int(context)} | " + " | ".join(f"{c:.2f}" for c in row) + " |")
