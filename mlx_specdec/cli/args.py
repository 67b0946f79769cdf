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


METHODS_HELP = ("ar (plain), mlx-lm (peer baseline), redrafter, apar, triforce (long prompts), auto (per request, "
                "ar or redrafter, whichever this engine measured faster); "
                "with --ranks: pp-ar, pp-spec, pipeinfer (the model split across processes or Macs)")
DRAFTER_HELP = "ReDrafter head directory ('auto' = the one shipped in models/ for this model, 'none' = no head)"


def _comma_list(text: str, kind=str) -> List:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"bad comma list {text!r}") from None


def expert_argument(p: argparse.ArgumentParser, *flags, help: str, **kwargs) -> None:
    """An option accepted on the command line but kept off the main --help: `--help-expert` lists it."""
    p.add_argument(*flags, help=argparse.SUPPRESS, **kwargs)
    if not hasattr(p, "expert_help"):
        p.expert_help = []
        p.add_argument("--help-expert", action=_ExpertHelp, nargs=0,
                       help="list the expert options (method tuning, pipeline simulation) and exit")
    p.expert_help.append((", ".join(flags), help))


class _ExpertHelp(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(f"expert options of `{parser.prog}` (also accepted as JSON fields by `serve`, see docs/server.md):")
        for flags, text in parser.expert_help:
            print(f"  {flags}\n      {text}")
        parser.exit()


def _setting_help(method: str, setting, kind: str) -> str:
    default = "auto" if setting.default is None else setting.show(setting.default)
    return f"{method}: {kind}{setting.help} ({setting.bounds()}; default: {default})"


def _add_method_args(p: argparse.ArgumentParser, lists: bool = False) -> None:
    """Method settings from the registry (settings.py); in `bench` they take comma lists and every
    combination runs. Expert settings are accepted but listed only by --help-expert."""
    from ..settings import method_settings

    kind = "comma list of " if lists else ""  # (a list setting's alternatives: separated by ";")
    p.add_argument("--drafter", default="auto", help=DRAFTER_HELP + (
        "; a comma list runs redrafter once per head, in the same run" if lists else ""))
    p.add_argument("--draft-model", default=None,
                   help="triforce --bottom model: a small model with the target's tokenizer (directory, "
                        "Hugging Face repo id or 'default')")
    for method, setting in method_settings():
        extra = dict(nargs="?", const="on") if setting.kind == "bool" else {}
        flags = setting.cli_flags
        if setting.expert:
            expert_argument(p, *flags, dest=setting.name, default=None, metavar="VALUE",
                            help=_setting_help(method.name, setting, kind), **extra)
        else:
            p.add_argument(*flags, dest=setting.name, default=None, help=_setting_help(method.name, setting, kind),
                           **extra)


def _parse(setting, value):
    from ..settings import SettingError

    try:
        return setting.parse(value)
    except SettingError as error:
        raise UserError(f"{setting.cli_flags[0]} {error.detail}") from None


def _method_options(args) -> dict:
    """One value per setting given (generate, chat)."""
    from ..settings import all_settings

    return {name: _parse(s, getattr(args, name)) for name, s in all_settings().items()
            if getattr(args, name, None) is not None}


def method_grids(args) -> dict:
    """{method: {option: [values]}} from comma lists (bench: every combination runs)."""
    from ..settings import method_settings

    grids: dict = {}
    for method, s in method_settings():
        text = getattr(args, s.name, None)
        if text:  # a list setting's values are themselves comma lists: its alternatives split on ";"
            values = [v for v in text.split(";") if v.strip()] if s.kind == "list" else _comma_list(text)
            grids.setdefault(method.name, {})[s.name] = [_parse(s, v) for v in values]
    return grids


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256, method: str = "ar") -> None:
    """The sampling flags; a model-default field left out takes the model's value (`_params`)."""
    from ..sampling_defaults import FIELDS, MEASURED
    from ..settings import SAMPLING

    p.add_argument("--method", default=method, help=f"decoding method: {METHODS_HELP} (default: {method})")
    for s in SAMPLING:
        default = max_tokens if s.name == "max_tokens" else (None if s.name in FIELDS else s.default)
        shown = "none" if default is None else default
        if s.name in FIELDS:
            shown = f"the model's generation_config.json, else {MEASURED.get(s.name, s.default)}"
        kind = {"int": int, "float": float}.get(s.kind, str)  # a choice: the registry parses its text
        shown = "the template's" if s.name == "thinking" else shown
        p.add_argument(*s.cli_flags, type=kind, default=default, help=f"{s.help} ({s.bounds()}; default: {shown})")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args, defaults=None, method: str = "ar"):
    """GenerationParams from the command line, each sampling value held to the registry's bounds;
    defaults (the model's, `Engine.sampling_defaults`): what a field left out takes, else the
    registry's own default."""
    from ..decoding import GenerationParams
    from ..sampling_defaults import fill
    from ..settings import SAMPLING

    given = {s.name: getattr(args, s.cli_flags[0][2:].replace("-", "_")) for s in SAMPLING}
    sampling = {s.name: _parse(s, given[s.name]) for s in SAMPLING if given[s.name] is not None}
    if defaults:
        sampling = fill(sampling, defaults, method)
    return GenerationParams(**sampling, stop=tuple(args.stop), options=_method_options(args))


def load_engine(args, reuse_prefix: bool = False):
    from ..engine import Engine, apar_adapter_spec

    print(f"Loading {args.model}...", file=sys.stderr, flush=True)
    return Engine.load(args.model, dtype=args.dtype, drafter=getattr(args, "drafter", "auto"),
                       apar_adapter=apar_adapter_spec(getattr(args, "apar_adapter", "auto")),
                       draft_model=getattr(args, "draft_model", None), reuse_prefix=reuse_prefix,
                       dequantize=getattr(args, "dequantize", "auto"))
