"""Arguments several commands share (model, method, sampling), their checks, and loading the engine."""

from __future__ import annotations

import argparse
import sys
from typing import List

from ..errors import UserError

MODEL_HELP = ("model: 'default' (embedded SmolLM2-135M-Instruct), 'default-4bit', a local model "
              "directory, a .gguf file, or a Hugging Face repo id (default: %(default)s)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="default", help=MODEL_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="compute dtype; auto = float32 on the CPU, the model's own on a GPU (Metal, CUDA)")
    p.add_argument("--dequantize", default="auto", choices=["auto", "on", "off"],
                   help="expand a quantized model's weights once at load: MLX's quantized matmul is slow on "
                        "the CPU for more than one row (prefill, verify); auto = on the CPU when the float32 "
                        "weights fit in 40%% of RAM (default: auto)")
    p.add_argument("--apar-adapter", default="auto",
                   help="apar: adapter directory (made by train-apar); 'auto' = the one shipped in models/ "
                        "for this model; 'none' = no adapter (default: auto)")


METHODS_HELP = ("ar (plain), mlx-lm (peer baseline), redrafter, apar, triforce (long prompts); "
                "with --ranks: pp-ar, pp-spec, pipeinfer (the model split across processes or Macs)")


def _on_off(value: str, flag: str) -> bool:
    if value.strip().lower() not in ("on", "off"):
        raise UserError(f"{flag} is on or off, not {value!r}")
    return value.strip().lower() == "on"


def _verify_cost_rule(text: str, flag: str):
    """on / off (bool) or "margin"."""
    rule = _choice(text, flag, ("on", "off", "margin"))
    return rule if rule == "margin" else rule == "on"


def _choice(text: str, flag: str, choices) -> str:
    if text.strip().lower() not in choices:
        raise UserError(f"{flag} is {' or '.join(choices)}, not {text!r}")
    return text.strip().lower()


def _whole_number(text: str, flag: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{flag} takes a whole number, not {text!r}") from None
    if value < minimum:
        raise UserError(f"{flag} must be at least {minimum}")
    return value


def _nonnegative_int(text: str, flag: str) -> int:
    return _whole_number(text, flag, 0)


def _positive_int(text: str, flag: str) -> int:
    return _whole_number(text, flag, 1)


def _fraction(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{flag} takes a number between 0 and 1, not {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise UserError(f"{flag} takes a number between 0 and 1, not {text!r}")
    return value


def _comma_list(text: str, kind=str) -> List:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"bad comma list {text!r}") from None


# Each method setting once: (method, option name, flag, help, parser of one value). generate and
# chat take one value; bench takes a comma list and runs every combination.
METHOD_SETTINGS = [
    ("redrafter", "beam_width", "--beam-width", "beam width W (default: 1)", _positive_int),
    ("redrafter", "draft_cutoff", "--draft-cutoff",
     "verify only the drafts the head gives at least this probability (each beam up to its first below); "
     "a step with none is a plain step; 0 = every draft (default: 0.1)",
     lambda text, flag: _fraction(text, flag)),
    ("redrafter", "draft_trust", "--draft-trust",
     "on = the cutoff applies to the head's probability times a running per-answer trust (accepted "
     "over expected, learnt while decoding), so a head that is sure and wrong (a long document it "
     "was not trained on) stops costing verifies; off = to the head's own probability (default: on)",
     _on_off),
    ("redrafter", "beam_length", "--beam-length",
     "beam length L, the LLM's token + up to L-1 drafts (default: 6)", _positive_int),
    ("redrafter", "lookup", "--lookup",
     "prompt lookup before the head: where the text so far ends in a 2-4 token sequence seen before "
     "(in the prompt or the answer), draft the N tokens that followed it instead of asking the head; "
     "0 = the head only (default: 4)", _nonnegative_int),
    ("redrafter", "runners_up", "--runners-up",
     "greedy chains: also verify up to N of the head's next likeliest first drafts, each beside the chain's "
     "first, where the verify-cost table says the extra query tokens pay; 0 = off. On the 2-core CPU 2 raise "
     "tokens a forward ~5 %% (1.64 -> 1.72 on unseen chats) at the same speed (default: 2)",
     _nonnegative_int),
    ("redrafter", "runners_up_depths", "--runners-up-depths",
     "greedy chains with runners-up: offer them beside the chain's first N drafts, a deeper one where the "
     "chain is likely to reach it (its gain: the chain's reach times its own probability) (default: 2)",
     _positive_int),
    ("redrafter", "runners_compete", "--runners-compete",
     "greedy chains with runners-up and a verify-cost table: on = the chain's deeper drafts and the runners-up "
     "compete for the verify's query tokens, the likeliest nodes first; off = the chain's depth is chosen "
     "first, then runners-up are added where they pay (default: on)", _on_off),
    ("redrafter", "head_beside_lookup", "--head-beside-lookup",
     "greedy chains with runners-up: on = where a row drafts from prompt lookup, the head's own first draft "
     "is a runner-up beside the lookup's first, verified where the verify-cost table says it pays (the head "
     "then drafts at every step); off = a lookup's chain alone (default: on)", _on_off),
    ("redrafter", "deepen_reach", "--deepen-reach",
     "greedy chains drafted lazily: one depth deeper only while the chain so far is at least this likely to be "
     "accepted whole (its calibrated confidences multiplied), since each depth costs the head a vocabulary "
     "projection and a sync; 0 = as deep as the cutoff allows (default: 0.25)",
     lambda text, flag: _fraction(text, flag)),
    ("redrafter", "prompt_draft", "--prompt-draft",
     "on = the head drafts the answer's first tokens from the prompt (the hidden state before its last "
     "token), so the first forward verifies drafts as every later one does; off = the first token alone, "
     "then drafts (default: off)", _on_off),
    ("redrafter", "eager_drafts", "--eager-drafts",
     "on = the head drafts every depth in one graph, read with the acceptance in the step's one host "
     "sync; off = each depth only when the cutoff could verify it, behind a sync of its own, and the "
     "head's drafts only where prompt lookup found none (on the CPU each depth's vocabulary projection "
     "costs ~3 ms; on an H200 the two tied) (default: off)", _on_off),
    ("redrafter", "verify_cost", "--verify-cost",
     "on = of the drafts the cutoff keeps, verify only as deep as they are worth at this context "
     "length's measured verify cost (this machine's table from `mlx-specdec calibrate`, else one shipped "
     "from a 2-core CPU; a long document makes each verified token dearer); "
     "off = every draft the cutoff keeps; margin = as on, but a draft is worth verifying when its "
     "expected tokens beat the answer's own tokens per unit of cost so far times what it adds to the cost "
     "(default: on; off with --draft-cutoff 0 and on a GPU not calibrated)", _verify_cost_rule),
    ("apar", "max_threads", "--max-threads", "most live threads per answer (default: 32)", _positive_int),
    ("apar", "max_depth", "--max-depth", "deepest fork, 0 = never fork (default: 2)", _nonnegative_int),
    ("apar", "fork_probe", "--fork-probe",
     "on = the original model writes until the first fork, decided by the adapter's fork probe (an "
     "unforked answer is the original's); off = the adapted model writes everything (default: on where "
     "the adapter ships a probe)", _on_off),
    ("triforce", "budget", "--budget", "retrieval cache budget: prompt keys kept per KV head (default: 512)",
     _positive_int),
    ("triforce", "gamma", "--gamma", "tokens the retrieval level collects per full-cache verify (default: 6)",
     _positive_int),
    ("triforce", "bottom", "--bottom",
     "the level below the retrieval level: ngram (prompt lookup), none, model (a small draft model over a "
     "StreamingLLM cache: --draft-model) or redrafter (the draft head) (default: ngram)",
     lambda text, flag: _choice(text, flag, ("ngram", "none", "model", "redrafter"))),
    ("triforce", "draft_length", "--draft-length", "tokens the bottom level drafts per retrieval-level verify, "
     "γ1 (default: 3)", _positive_int),
    ("triforce", "middle_cache", "--middle-cache",
     "the middle level's cache: retrieval (the prompt's best chunks) or streaming (sink + most recent "
     "prompt tokens, StreamingLLM's choice, for comparison) (default: retrieval)",
     lambda text, flag: _choice(text, flag, ("retrieval", "streaming"))),
    ("triforce", "score_window", "--score-window",
     "the last prompt tokens whose queries choose the retrieved chunks (default: 16)", _positive_int),
    ("triforce", "score_reduce", "--score-reduce",
     "how the query heads that share a KV head score a chunk together: mean or max (default: mean)",
     lambda text, flag: _choice(text, flag, ("mean", "max"))),
    ("triforce", "rebuild_stride", "--rebuild-stride",
     "rebuild the retrieval cache every N generated tokens from the latest token's queries; 0 = never "
     "(default: 0)", _nonnegative_int),
    ("triforce", "rebuild_below", "--rebuild-below",
     "rebuild the retrieval cache when its rolling acceptance (last 8 verifies) falls below this; 0 = never "
     "(default: 0)", lambda text, flag: _fraction(text, flag)),
]


DRAFTER_HELP = "ReDrafter head directory ('auto' = the one shipped in models/ for this model, 'none' = no head)"


def _add_method_args(p: argparse.ArgumentParser, lists: bool = False) -> None:
    """Method settings; in `bench` they take comma lists and every combination runs."""
    kind = "comma list of " if lists else ""
    p.add_argument("--drafter", default="auto", help=DRAFTER_HELP + (
        "; a comma list runs redrafter once per head, in the same run" if lists else ""))
    p.add_argument("--draft-model", default=None,
                   help="triforce --bottom model: a small model with the target's tokenizer (directory, "
                        "Hugging Face repo id or 'default')")
    for method, _, flag, text, _ in METHOD_SETTINGS:
        p.add_argument(flag, default=None, help=f"{method}: {kind}{text}")
        if flag == "--beam-length":  # argparse lists options in the order they are added
            p.add_argument("--profile", action="store_true",
                           help="redrafter: sync after each phase to report draft/verify/accept time (slower)")


def _method_options(args) -> dict:
    """One value per setting given (generate, chat)."""
    options = {name: parser(getattr(args, name), flag)
               for _, name, flag, _, parser in METHOD_SETTINGS if getattr(args, name) is not None}
    if args.profile:
        options["profile"] = True
    return options


def method_grids(args) -> dict:
    """{method: {option: [values]}} from comma lists (bench: every combination runs)."""
    grids: dict = {}
    for method, name, flag, _, parser in METHOD_SETTINGS:
        if getattr(args, name):
            grids.setdefault(method, {})[name] = [parser(v, flag) for v in _comma_list(getattr(args, name))]
    if args.profile:
        grids.setdefault("redrafter", {})["profile"] = [True]
    return grids


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    p.add_argument("--method", default="ar", help=f"decoding method: {METHODS_HELP} (default: ar)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args):
    from ..decoding import GenerationParams

    if args.max_tokens <= 0:
        raise UserError("--max-tokens must be positive")
    if args.temp < 0:
        raise UserError("--temp must be >= 0")
    return GenerationParams(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p,
                            seed=args.seed, stop=tuple(args.stop), options=_method_options(args))


def load_engine(args, reuse_prefix: bool = False):
    from ..engine import Engine, apar_adapter_spec

    print(f"Loading {args.model}...", file=sys.stderr, flush=True)
    return Engine.load(args.model, dtype=args.dtype, drafter=getattr(args, "drafter", "auto"),
                       apar_adapter=apar_adapter_spec(getattr(args, "apar_adapter", "auto")),
                       draft_model=getattr(args, "draft_model", None), reuse_prefix=reuse_prefix,
                       dequantize=getattr(args, "dequantize", "auto"))
