"""The method registry: every decoding method and each of its settings, declared once.

A `Setting` says its name, type, default, bounds and a one-line help; a `Method` says whether its
requests can share a batch and which artifacts it needs. Everything a user touches is made from
this table: the CLI flags (`cli/args.py`), the server's accepted fields and their parsing
(`serve/requests.py`), the chat's settings screen (`tui/screens.py`), the server's batch key
(`batch_key`) and the settings table in docs/server.md (`python -m mlx_specdec.settings --markdown`).

Every caller parses a value through `Setting.parse`, so the CLI's text, the chat's text and the
server's JSON are held to the same type and bounds; a bad value raises `SettingError`, which each
caller words for its own field name (a flag, a JSON field, a label).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple

import importlib

from .decoding.base import GenerationParams
from .drafting.sources import source_names


class SettingError(ValueError):
    """A value a setting does not take; `detail` reads after the setting's name."""

    def __init__(self, name: str, detail: str):
        super().__init__(f"{name} {detail}")
        self.name, self.detail = name, detail


@dataclass(frozen=True)
class Setting:
    name: str  # the option name: the server's JSON field, GenerationParams.options' key
    kind: str  # "int", "float", "bool" (on/off), "choice" or "list" (comma-separated names)
    default: object  # None: the method decides (the setting is left out of the options)
    help: str
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False  # low itself is not allowed
    choices: Tuple[str, ...] = ()
    values: Optional[Mapping[str, object]] = None  # choice -> the value the method reads
    expert: bool = False  # off the main --help (listed by --help-expert) and folded in the chat
    flags: Tuple[str, ...] = ()  # CLI flags; default: --name-with-dashes
    check: Optional[Callable[[str], object]] = None  # "list": text -> the value (ValueError: refused)
    takes: str = ""  # "list": what it takes, in words

    @property
    def cli_flags(self) -> Tuple[str, ...]:
        return self.flags or ("--" + self.name.replace("_", "-"),)

    @property
    def label(self) -> str:
        return self.name.replace("_", " ")

    def bounds(self) -> str:
        if self.kind == "list":
            return self.takes
        if self.kind == "choice":
            return " or ".join(self.choices)
        if self.kind == "bool":
            return "on or off"
        what = "a whole number" if self.kind == "int" else "a number"
        if self.low is not None and self.high is not None:
            return f"{what} from {_num(self.low)}{' (exclusive)' if self.low_open else ''} to {_num(self.high)}"
        if self.low is not None:
            return f"{what} {'above' if self.low_open else 'of at least'} {_num(self.low)}"
        return what

    def parse(self, value: object, json: bool = False) -> object:
        """Text (CLI, chat) or a JSON value (server, json=True: a number must be a JSON number)
        -> the value the method reads."""
        verb = "is" if self.kind in ("bool", "choice") else "takes"
        bad = SettingError(self.name, f"{verb} {self.bounds()}, not {_show(value)}")
        if self.values and any(type(value) is type(v) and value == v for v in self.values.values()):
            return value  # already parsed
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("on", "off", "true", "false"):
                return value.strip().lower() in ("on", "true")
            raise bad
        if self.kind == "list":
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                value = ",".join(value)
            if not isinstance(value, str):
                raise bad
            try:
                return self.check(value)
            except ValueError as error:
                raise SettingError(self.name, str(error)) from None
        if self.kind == "choice":
            if not isinstance(value, str) or value.strip().lower() not in self.choices:
                raise bad
            text = value.strip().lower()
            return self.values[text] if self.values else text
        number = None if json and isinstance(value, str) else _number(value, self.kind == "int")
        if number is None:
            raise bad
        if self.low is not None and (number <= self.low if self.low_open else number < self.low):
            raise bad
        if self.high is not None and number > self.high:
            raise bad
        return number

    def show(self, value: object) -> str:
        """A value as the user types it."""
        if self.kind == "bool":
            return "on" if value else "off"
        if self.values:
            return next((text for text, v in self.values.items() if v == value), str(value))
        return "" if value is None else str(value)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: object, whole: bool) -> Optional[float]:
    """An int or a finite float from a JSON number or text; None where it is neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            return None
    if isinstance(value, int):
        return value if whole else float(value)
    if isinstance(value, float) and math.isfinite(value):
        if whole:
            return int(value) if value.is_integer() else None
        return value
    return None


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    settings: Tuple[Setting, ...] = ()
    batches: bool = False  # several requests waiting together decode as rows of one batch
    joins: bool = False  # requests join a running batch at its next step (continuous batching)
    needs: Tuple[str, ...] = ()  # artifacts: "drafter" (a ReDrafter head), "apar_adapter"

    def setting(self, name: str) -> Setting:
        return next(s for s in self.settings if s.name == name)


def _on_off(name, default, help, expert=True) -> Setting:
    return Setting(name, "bool", default, help, expert=expert)


def _int(name, default, low, high, help, expert=False) -> Setting:
    return Setting(name, "int", default, help, low=low, high=high, expert=expert)


def _fraction(name, default, help, expert=False) -> Setting:
    return Setting(name, "float", default, help, low=0.0, high=1.0, expert=expert)


# the methods' own defaults (their modules say why each is what it is)
R = importlib.import_module(".decoding.redrafter", __package__)
REDRAFTER = (
    _int("beam_width", R.DEFAULT_BEAM_WIDTH, 1, 16, "beams W the head drafts per step"),
    _int("beam_length", R.DEFAULT_BEAM_LENGTH, 2, 16, "beam length L: the target's token and up to L-1 drafts"),
    _fraction("draft_cutoff", R.DEFAULT_DRAFT_CUTOFF,
              "verify only drafts at least this likely (each beam up to its first below); 0 = every draft"),
    _int("lookup", R.DEFAULT_LOOKUP, 0, 16,
         "prompt lookup first: draft the N tokens that followed the text's last 2-4 tokens earlier; 0 = off"),
    _on_off("draft_trust", R.DEFAULT_DRAFT_TRUST,
            "scale each source's confidence by how often its drafts were accepted in this answer"),
    Setting("verify_cost", "choice", "on" if R.DEFAULT_VERIFY_COST is True else R.DEFAULT_VERIFY_COST,
            "verify only as deep as drafts are worth at this context's measured verify cost "
            "(`mlx-specdec calibrate`); margin = against the answer's own rate",
            choices=("on", "off", "margin"), values={"on": True, "off": False, "margin": "margin"}, expert=True),
    _int("runners_up", R.DEFAULT_RUNNERS_UP, 0, 8,
         "greedy: also verify up to N of the head's next likeliest drafts beside the chain's", expert=True),
    _int("runners_up_depths", R.DEFAULT_RUNNERS_UP_DEPTHS, 1, 8,
         "greedy: offer runners-up beside the chain's first N drafts", expert=True),
    _on_off("runners_compete", R.DEFAULT_RUNNERS_COMPETE,
            "runners-up and the chain's deeper drafts compete for the verify's tokens, likeliest first"),
    _on_off("head_beside_lookup", R.DEFAULT_HEAD_BESIDE_LOOKUP,
            "where a row drafts from lookup, offer the head's first draft beside the lookup's"),
    _fraction("deepen_reach", R.DEFAULT_DEEPEN_REACH,
              "lazy chains: draft one depth deeper only while the chain is this likely to be accepted whole",
              expert=True),
    _on_off("prompt_draft", R.DEFAULT_PROMPT_DRAFT, "draft the answer's first tokens from the prompt"),
    _on_off("eager_drafts", R.DEFAULT_EAGER_DRAFTS,
            "draft every depth in one graph, read in the step's one sync, instead of depth by depth"),
    _on_off("sampled_drafts", R.DEFAULT_SAMPLED_DRAFTS,
            "sampling: the head samples W chains, accepted by rejection sampling; off = its likeliest tree, "
            "each node accepting where it equals the target's own sample"),
    _on_off("profile", False, "sync after each phase to report draft/verify/accept time (slower)"),
    Setting("step", "choice", R.DEFAULT_STEP, "how a step meets the device: device = one read, one upload, "
            "bucketed shapes (a GPU's); host = drafts read depth by depth, only as deep as verified (a CPU's); "
            "auto = by where MLX computes", choices=("auto", "device", "host"), expert=True),
    Setting("sources", "list", R.DEFAULT_SOURCES, "the drafting sources asked for each row's drafts, in order: "
            "the first that offers a chain drafts the row, the head (last) the rest", expert=True,
            check=lambda text: ",".join(source_names(text)),
            takes="a comma list of drafting sources (drafting/sources.py), the head last"),
)

T = importlib.import_module(".decoding.triforce", __package__)
TB = importlib.import_module(".decoding.triforce_bottom", __package__)
TRIFORCE = (
    _int("budget", T.DEFAULT_BUDGET, 16, 65536, "retrieval cache budget: prompt keys kept per KV head"),
    _int("gamma", T.DEFAULT_GAMMA, 1, 64, "tokens the retrieval level collects per full-cache verify (γ2)"),
    Setting("bottom", "choice", TB.DEFAULT_BOTTOM, "the level below the retrieval level: ngram (prompt lookup), none, "
            "model (--draft-model) or redrafter (the draft head)", choices=tuple(TB.BOTTOMS)),
    _int("draft_length", T.DEFAULT_DRAFT, 1, 32, "tokens the bottom level drafts per retrieval-level verify (γ1)"),
    Setting("middle_cache", "choice", T.DEFAULT_MIDDLE_CACHE, "the middle level's cache: retrieval (the prompt's best "
            "chunks) or streaming (sink + recent tokens)", choices=tuple(T.MIDDLE_CACHES), expert=True),
    _int("score_window", T.DEFAULT_SCORE_WINDOW, 1, 4096, "the last prompt tokens whose queries choose the chunks",
         expert=True),
    Setting("score_reduce", "choice", T.DEFAULT_SCORE_REDUCE, "how query heads sharing a KV head score a chunk: mean or max",
            choices=("mean", "max"), expert=True),
    _int("rebuild_stride", T.DEFAULT_REBUILD_STRIDE, 0, 1_000_000, "rebuild the retrieval cache every N generated tokens; 0 = never",
         expert=True),
    _fraction("rebuild_below", T.DEFAULT_REBUILD_BELOW, "rebuild the retrieval cache when its rolling acceptance falls below this; "
              "0 = never", expert=True),
    _int("draft_sink", TB.DEFAULT_DRAFT_SINK, 0, 4096, "--bottom model: the draft model's attention-sink tokens", expert=True),
    _int("draft_window", TB.DEFAULT_DRAFT_WINDOW, 1, 65536, "--bottom model: the draft model's recent-token window", expert=True),
)

A = importlib.import_module(".decoding.apar", __package__)
APAR = (
    _int("max_threads", A.DEFAULT_MAX_THREADS, 1, 64, "most live threads per answer"),
    _int("max_depth", A.DEFAULT_MAX_DEPTH, 0, 8, "deepest fork; 0 = never fork"),
    _on_off("fork_probe", True, "the original model writes until the first fork, which the adapter's probe "
            "decides (where the adapter ships one)"),
    _on_off("speculate", True, "threads draft from what their siblings wrote"),
    Setting("sibling_penalty", "float", importlib.import_module(".apar.siblings", __package__).DEFAULT_PENALTY,
            "a line that follows a head its threads already wrote (after the head's first word) loses this "
            "much logit; 0 = off, 100 or more = never written", low=0.0, high=1000.0, expert=True),
)

METHODS: Dict[str, Method] = {m.name: m for m in (
    Method("ar", "plain decoding, one token a forward", joins=True),
    Method("auto", "per request, ar or redrafter: the one measured (or, before that, predicted) faster here"),
    Method("mlx-lm", "mlx-lm's own generate loop (the peer baseline)"),
    Method("redrafter", "an RNN draft head and prompt lookup draft trees, verified in one forward",
           REDRAFTER, batches=True, joins=True, needs=("drafter",)),
    Method("apar", "the adapted model forks a thread per paragraph; threads decode together",
           APAR, needs=("apar_adapter",)),
    Method("triforce", "long prompts: the target over a retrieval cache drafts for the full cache", TRIFORCE),
)}

#: sampling settings every method takes (GenerationParams' fields; the CLI says --temp)
SAMPLING = (
    _int("max_tokens", 256, 1, 1_000_000, "tokens to generate at most"),
    Setting("temperature", "float", 0.0, "temperature; 0 = greedy", low=0.0, high=2.0, flags=("--temp",)),
    Setting("top_p", "float", 1.0, "nucleus sampling threshold", low=0.0, high=1.0, low_open=True),
    Setting("seed", "int", None, "random seed for sampling", low=0),
    Setting("frequency_penalty", "float", 0.0, "OpenAI's: lower each token's logit by this times its count in "
            "the answer so far", low=-2.0, high=2.0),
    Setting("presence_penalty", "float", 0.0, "OpenAI's: lower the logit of every token already in the answer "
            "by this", low=-2.0, high=2.0),
    Setting("repetition_penalty", "float", 1.0, "mlx-lm's: divide the positive logits (multiply the negative "
            "ones) of the last repetition_context_size tokens by this; 1 = off", low=0.0, high=10.0, low_open=True),
    _int("repetition_context_size", 20, 1, 4096, "the tokens the repetition penalty looks back over"),
    Setting("thinking", "choice", None, "the chat template's thinking mode (Qwen3's enable_thinking: a "
            "<think>...</think> before the answer); left out, the template's own default",
            choices=("on", "off"), values={"on": True, "off": False}),
)

#: GenerationParams fields a batch row keeps for itself; every other field must match to share a batch
#: (thinking shapes a row's prompt only)
PER_ROW = ("max_tokens", "stop", "options", "thinking")


def method_settings() -> Iterable[Tuple[Method, Setting]]:
    for method in METHODS.values():
        for setting in method.settings:
            yield method, setting


def all_settings() -> Dict[str, Setting]:
    """Every method setting by name (a name means the same in every method that has it)."""
    return {s.name: s for _, s in method_settings()}


def resolve(method: str, given: Mapping[str, object], json: bool = False) -> Dict[str, object]:
    """The method's every setting: the given ones parsed (SettingError on a bad one), the rest
    their defaults. Given settings of other methods are checked too, and dropped."""
    known = all_settings()
    for name, value in given.items():
        if name in known:
            known[name].parse(value, json)
    spec = METHODS.get(method)
    if spec is None:
        return {}
    out = {}
    for s in spec.settings:
        if s.name in given:
            out[s.name] = s.parse(given[s.name], json)
        elif s.default is not None:
            out[s.name] = s.parse(s.default) if s.values else s.default
    return out


def batch_key(method: str, params: GenerationParams) -> Tuple:
    """Requests with equal keys can be rows of one batch: the same method, every shared
    sampling field equal, and every method setting equal (defaults filled in)."""
    spec = METHODS[method]
    shared = tuple((f.name, getattr(params, f.name)) for f in dataclasses.fields(params) if f.name not in PER_ROW)
    if params.greedy:  # greedy rows ignore the temperature and top-p
        shared = tuple((k, v) for k, v in shared if k not in ("temperature", "top_p"))
    settings = resolve(method, {k: v for k, v in params.options.items() if k in {s.name for s in spec.settings}})
    extra = tuple(sorted((k, repr(v)) for k, v in params.options.items() if k not in settings))
    return (method, shared, tuple(sorted(settings.items(), key=lambda kv: kv[0])), extra)


def markdown() -> str:
    """The settings table of docs/server.md: every method's settings, with type, default and help."""
    lines = ["| method | field (CLI flag) | takes | default | what it does |", "|---|---|---|---|---|"]
    for method, s in method_settings():
        default = "auto" if s.default is None else s.show(s.default)
        expert = " (expert)" if s.expert else ""
        lines.append(f"| {method.name} | `{s.name}` (`{s.cli_flags[0]}`){expert} | {s.bounds()} | {default} | {s.help} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m mlx_specdec.settings --markdown")
    print(markdown())
