"""The engine's public API: load a model once, then stream `Event`s for prompts or chats.

    engine = Engine.load("default")
    for event in engine.generate("Why is the sky blue?", method="ar"):
        print(event.text, end="")

Everything the CLI, the bench and the chat app do goes through `Engine.generate`/`Engine.chat`.
"""

from __future__ import annotations

import os

from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Union

from .cache.prefix import PrefixStore
from .decoding import STRATEGIES, Event, GenerationParams, stream_events
from .decoding.batch import stream_batch
from .engine_measured import MeasuredMixin
from .settings import METHODS
from .errors import UserError
from .model.loader import LoadedModel, load_model
from .penalties import check_method as check_penalties


class UnknownMethod(UserError):
    pass


#: methods that decode several prompts together as rows of one batch (declared in the registry)
BATCH_METHODS = {m.name for m in METHODS.values() if m.batches}
#: methods whose requests join a running batch at its next step (continuous batching)
JOIN_METHODS = {m.name for m in METHODS.values() if m.joins}


AUTO = "auto"  # per request, the method predicted fastest here (auto.py)


def check_method(method: str) -> None:
    if method not in STRATEGIES and method != AUTO:
        raise UnknownMethod(f"unknown method {method!r} (choose from {', '.join(STRATEGIES)}, {AUTO})")


#: where the project's own trained artifacts (drafter heads, adapters) live, next to their cards
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


def apar_adapter_spec(value: str) -> Optional[str]:
    """--apar-adapter as Engine.load takes it: 'auto', a directory, or None for 'none'."""
    return None if value == "none" else value


#: strategies that resume from the prefix store (through decoding/base.py's `prefilled_cache`;
#: `ar` and `redrafter` also as rows of the server's continuous batch); only these report cached
#: prompt tokens
PREFIX_METHODS = ("ar", "triforce", "redrafter")


def check_same_tokenizer(lm: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must write the target's tokens: the same vocabulary, token for token."""
    rows = [m.model.model.embed_tokens.weight.shape[0] for m in (lm, draft)]  # the logits' width
    if rows[0] != rows[1] or lm.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise UserError(f"the draft model {draft.name} does not share {lm.name}'s tokenizer "
                        f"({rows[1]} vs {rows[0]} token embeddings)")


class Engine(MeasuredMixin):
    def __init__(self, lm: LoadedModel, drafter: Optional[str] = "auto",
                 apar_adapter: Optional[str] = "auto", draft_model: Optional[LoadedModel] = None,
                 reuse_prefix: Union[bool, PrefixStore] = False):
        """draft_model: a small model with lm's tokenizer (triforce's `--bottom model`).
        reuse_prefix: keep recent prompts' KV caches and resume each request from the one sharing
        the longest prefix (`cache/prefix.py`; the PREFIX_METHODS): True for a store with the
        default bounds, or the store itself. A chat or a server wants it; a bench must not have it
        (a second method would skip its prefill)."""
        self.lm = lm
        self.drafter_spec = drafter
        self.remember_auto = False  # Engine.load: `auto` reads and writes its measurements' store
        self.apar_adapter_spec = apar_adapter
        self._resources: Dict[str, object] = {}
        self.draft_model = draft_model
        self.prefix_store = reuse_prefix if isinstance(reuse_prefix, PrefixStore) else (
            PrefixStore() if reuse_prefix else None)
        if draft_model is not None:
            check_same_tokenizer(lm, draft_model)

    @classmethod
    def load(cls, model: Optional[str] = "default", dtype: str = "auto",
             drafter: Optional[str] = "auto", apar_adapter: Optional[str] = "auto",
             draft_model: Optional[str] = None, reuse_prefix: Union[bool, PrefixStore] = False, dequantize: str = "auto") -> "Engine":
        """drafter / apar_adapter: 'auto' (one shipped in models/ for this model, if any), a
        directory, or None (the command line's 'none'). draft_model: a model spec as `model` (triforce's bottom level).
        dequantize: a quantized model's weights expanded once at load (auto: on the CPU when
        memory allows; model/loader.py)."""
        drafter = None if drafter == "none" else drafter
        lm = load_model(model, dtype=dtype, dequantize=dequantize)
        engine = cls(lm, drafter, apar_adapter,
                     load_model(draft_model, dtype=lm.dtype, dequantize=dequantize) if draft_model else None,
                     reuse_prefix=reuse_prefix)
        engine.remember_auto = True  # `auto`'s measurements kept across processes (auto.py)
        if drafter not in (None, "auto"):
            engine.drafter  # load now: a mismatched head is reported before anything runs
        if apar_adapter not in (None, "auto"):
            engine.apar_lm
        return engine

    @property
    def apar_lm(self) -> Optional[LoadedModel]:
        """The model APAR decodes with: this one if it has [Fork]/[Child] tokens (an official
        APAR checkpoint), else this one with an APAR adapter (loaded on first use), else None."""
        if "apar_lm" not in self._resources:
            from .apar.adapter import find_shipped_adapter, load_apar_model
            from .apar.tokens import control_tokens_for

            spec = self.apar_adapter_spec
            if control_tokens_for(self.lm) is not None:
                self._resources["apar_lm"] = self.lm
            elif spec is None:
                self._resources["apar_lm"] = None
            else:
                directory = find_shipped_adapter(self.lm, MODELS_DIR) if spec == "auto" else Path(spec).expanduser()
                self._resources["apar_lm"] = load_apar_model(directory, self.lm) if directory else None
        return self._resources["apar_lm"]

    def lm_for(self, method: str) -> LoadedModel:
        """The model a method decodes with (APAR's adapted model; the original for the others)."""
        if method == "apar":
            return self.apar_lm or self.lm
        return self.lm

    @property
    def drafter(self):
        """The ReDrafter head for this model, loaded on first use (None if there is none)."""
        if "drafter" not in self._resources:
            self._resources["drafter"] = self._load_head(self.drafter_spec)
        return self._resources["drafter"]

    @property
    def verify_costs(self):
        """ReDrafter's verify-cost table for this model here (drafting/cost_probe.py), read once."""
        if "verify_costs" not in self._resources:
            from .drafting.cost_probe import cost_table_for

            self._resources["verify_costs"] = cost_table_for(self.lm)
        return self._resources["verify_costs"]

    def drafter_for(self, spec: Optional[str]):
        """A head by directory (bench compares several: `--drafter A,B`), loaded once; None or
        the engine's own spec: the engine's head."""
        if spec is None or spec == self.drafter_spec:
            return self.drafter
        heads = self._resources.setdefault("drafters", {})
        if spec not in heads:
            heads[spec] = self._load_head(spec)
        return heads[spec]

    def _load_head(self, spec: Optional[str]):
        """None / 'none': no head; 'auto': the one shipped in models/ for this model; else a directory."""
        if spec in (None, "none"):
            return None
        if spec == "auto":
            return self._find_shipped_drafter()
        from .redrafter_head.model import load_drafter

        return load_drafter(Path(spec).expanduser(), self.lm)

    def _find_shipped_drafter(self):
        from .redrafter_head.model import DrafterMismatch, load_drafter

        for directory in sorted(MODELS_DIR.glob("drafter-*")):
            if (directory / "config.json").exists():
                try:
                    return load_drafter(directory, self.lm)
                except DrafterMismatch:  # trained for another model
                    continue
        return None

    def _resources_for(self, method: str, params: Optional[GenerationParams] = None) -> Dict[str, object]:
        resources: Dict[str, object] = {}
        if method in PREFIX_METHODS and self.prefix_store is not None:
            resources["prefix_store"] = self.prefix_store
        if method == "redrafter":
            resources["drafter"] = self.drafter_for(params.options.get("drafter") if params else None)
            resources["verify_costs"] = self.verify_costs
            resources["step_overhead"] = self.step_overhead(resources["drafter"])
            resources["draft_model"] = self.draft_model
        if method == "triforce":  # for --bottom redrafter / model
            resources.update(drafter=self.drafter, draft_model=self.draft_model)
        return resources

    def step_overhead(self, head) -> Optional[float]:
        """A draft step's fixed cost with this head, in one-token forwards (drafting/step_cost.py):
        off the CPU (the device step's), stored for this machine or measured at first use; else None."""
        key = ("step_overhead", id(head))
        if key not in self._resources:
            from .model.device import on_cpu

            if head is None or on_cpu():  # the CPU's host-read step drafts lazily: not planned with it
                self._resources[key] = None
                return None
            from .decoding.redrafter import DEFAULT_BEAM_LENGTH, DEFAULT_RUNNERS_UP, DEFAULT_RUNNERS_UP_DEPTHS
            from .drafting.cost_probe import NO_FIRST_USE_ENV
            from .drafting.step_cost import step_overhead_for

            self._resources[key] = step_overhead_for(
                self.lm, head, str(self.drafter_spec or "none"), DEFAULT_BEAM_LENGTH, DEFAULT_RUNNERS_UP,
                DEFAULT_RUNNERS_UP_DEPTHS, measure=not os.environ.get(NO_FIRST_USE_ENV))
        return self._resources[key]

    @property
    def sampling_defaults(self):
        """(the sampling fields a request leaves out, where they come from): the model's
        generation_config.json, else the measured default (sampling_defaults.py)."""
        from .sampling_defaults import model_defaults

        return model_defaults(self.lm.path)

    @property
    def methods(self) -> List[str]:
        return list(STRATEGIES) + [AUTO]

    def method_support(self) -> Dict[str, Optional[str]]:
        """Per method: None where this model can run it, else why not (one line). Loads the
        artifacts a method needs (the head, the APAR adapter): call it on the thread that decodes."""
        support: Dict[str, Optional[str]] = dict.fromkeys(self.methods)
        if self.apar_lm is None:
            support["apar"] = (f"{self.lm.name} has no [Fork]/[Child] control tokens and no APAR adapter "
                               "(`mlx-specdec train-apar` makes one)")
        return support

    def generate_ids(self, prompt_ids: List[int], method: str = "ar",
                     params: Optional[GenerationParams] = None) -> Iterator[Event]:
        check_method(method)
        params = params or GenerationParams()
        choice = None
        if method == AUTO:
            choice = self.choose_method(prompt_ids, params)
            method = choice.method
        check_penalties(method, params)
        events = stream_events(self.lm_for(method), list(prompt_ids), STRATEGIES[method], params, method,
                               resources=self._resources_for(method, params))
        return self._measured(events, method, len(prompt_ids), params, choice)

    def joins(self, method: str, params: Optional[GenerationParams] = None) -> bool:
        """Whether a request can be a row of a continuous batch (`continuous_decoder`)."""
        if method not in JOIN_METHODS:
            return False
        if method == "redrafter":
            from .decoding.redrafter_join import joinable

            params = params or GenerationParams()
            return joinable(params, self._resources_for(method, params))
        return True

    def continuous_decoder(self, method: str = "ar", params: Optional[GenerationParams] = None):
        """A batch that requests join at the next step and leave when they end (decoding/continuous.py,
        decoding/redrafter_join.py); params: the settings its rows share (redrafter's options,
        sampling and penalties; `ar`'s rows each have their own)."""
        from .decoding.continuous import ContinuousDecoder

        params = params or GenerationParams()
        if not self.joins(method, params):
            raise UserError(f"method {method!r} has no continuous batching with these settings "
                            f"(it has: {', '.join(sorted(JOIN_METHODS))})")
        if method == "redrafter":
            from .decoding.redrafter_join import ContinuousRedrafter

            check_penalties(method, params)
            return ContinuousRedrafter(self.lm_for(method), self._resources_for(method, params), params)
        return ContinuousDecoder(self.lm_for(method), self._resources_for(method), method)

    def generate_ids_batch(self, prompts_ids: List[List[int]], method: str = "redrafter",
                           params: Optional[GenerationParams] = None,
                           rows: Optional[List[GenerationParams]] = None,
                           cancelled: Optional[Callable[[int], bool]] = None) -> Iterator[Event]:
        """Several prompts decoded together; each row's events carry thread_id = its index, and a
        row that ends gets a `thread_end` event with its own stats (decoding/batch.py). rows: each
        row's max_tokens and stop strings (the sampling settings are `params`'); cancelled(row):
        true once that row's request is abandoned (it leaves the batch at the next step)."""
        check_method(method)
        check_penalties(method, params or GenerationParams())
        if method not in BATCH_METHODS:
            raise UserError(f"method {method!r} decodes one prompt at a time "
                            f"(batches: {', '.join(sorted(BATCH_METHODS))})")
        if not prompts_ids:
            raise UserError("empty batch")
        return stream_batch(self.lm, prompts_ids, STRATEGIES[method], params or GenerationParams(), method,
                            resources=self._resources_for(method, params), rows=rows, cancelled=cancelled)

    def generate_batch(self, prompts: List[str], method: str = "redrafter",
                       params: Optional[GenerationParams] = None, chat_template: bool = True) -> Iterator[Event]:
        thinking = (params or GenerationParams()).thinking
        return self.generate_ids_batch([self.lm.encode_prompt(p, chat=chat_template, thinking=thinking)
                                        for p in prompts], method, params)

    def generate(self, prompt: str, method: str = "ar", params: Optional[GenerationParams] = None,
                 chat_template: bool = True) -> Iterator[Event]:
        thinking = (params or GenerationParams()).thinking
        return self.generate_ids(self.lm.encode_prompt(prompt, chat=chat_template, thinking=thinking), method, params)

    def chat(self, messages: List[dict], method: str = "ar",
             params: Optional[GenerationParams] = None) -> Iterator[Event]:
        """messages: [{"role": "user"|"assistant"|"system", "content": str}, ...]"""
        return self.generate_ids(self.lm.encode_chat(messages, thinking=(params or GenerationParams()).thinking),
                                 method, params)
