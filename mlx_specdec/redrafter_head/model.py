"""ReDrafter's recurrent draft head (Cheng et al., arXiv 2403.09919), for one LLM.

    s_1 = e_1                                   e_t: the LLM's own (frozen) token embedding
    s_t = SiLU(U s_{t-1} + W e_t + b)            RNN state, size E (the embedding size)
    g_t = [s_t, h]                               h: the LLM's last final-norm hidden state
    g  <- g + SiLU(Linear(g))   (num_blocks times)
    logits_t = Linear(g, K)                      output="draft_vocab": a learned K-way projection
    logits_t = (Linear(g, D)) @ O_K^T            output="llm_head": predict the LLM's next hidden
                                                 state, score it with the LLM's own output rows O_K

The caller embeds tokens with the LLM's `embed_tokens`; the head owns only U, W, b, the blocks
and the projection. The projection covers a draft vocabulary of the K most frequent tokens of
the distillation answers instead of the LLM's full vocabulary (for SmolLM2-135M a full
1152 x 49152 projection is ~40% of the LLM's parameters, paid every beam step);
`draft_to_full` maps draft index -> LLM token id and `full_to_draft` the other way (-1 = none).

With output="llm_head" (an EAGLE-like low-rank output) the head only learns a D-wide projection;
the K x D output rows are the LLM's own (frozen, not stored: taken from the LLM at load time).
Far fewer trained parameters (a learned K-wide projection overfits a small distillation set),
and training can also regress the predicted hidden state onto the LLM's real next hidden state.

Three config fields describe heads trained elsewhere (Apple's `recurrent_drafting`, imported by
`mlx-specdec import-drafter`); their defaults are the head above:
    initial_state="zero"   s_0 = 0 and s_1 = next_state(0, e_1) instead of s_1 = e_1
    recurrence="sum"       s_t = s_{t-1} + e_t (no U, W, b)
    exit_dim=F             g <- Linear(g, F) before the blocks, which are then F wide
    logits_top_k=k         logits below the k-th largest are pushed 50000 below the largest
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ..errors import UserError
from ..model.cpu_layout import COLUMN, column_major, current_layout, store_layout
from ..model.device import on_cpu

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class DrafterMismatch(UserError):
    """The drafter was trained for another model (hidden size, vocabulary or tokenizer)."""


@dataclass
class DrafterConfig:
    llm_hidden_size: int  # the LLM's final hidden size (576 for SmolLM2-135M)
    embed_size: int  # the LLM's token-embedding size; the RNN state has this size
    vocab_size: int  # the LLM's full vocabulary
    draft_vocab_size: int  # K: size of the draft vocabulary
    num_blocks: int = 2  # residual blocks x + SiLU(Linear(x)) on [s_t, h]
    draft_length: int = 5  # tokens trained to predict after the LLM's own token
    model_name: str = ""
    tokenizer_hash: str = ""
    output: str = "draft_vocab"  # "draft_vocab" | "llm_head" (see the module docstring)
    # Greedy drafting's confidence is softmax(logits / this)[drafted token]: fitted on held-out
    # answers so it is the chance the target's own token is the drafted one (benchmarks/
    # drafter_calibration.py). 1 for a head trained on hard labels; below 1 sharpens a head trained
    # on the LLM's soft distribution, whose probabilities are the LLM's, not greedy acceptance's.
    confidence_temperature: float = 1.0
    recurrence: str = "rnn"  # "rnn": s_t = SiLU(U s + W e + b) | "sum": s_t = s_{t-1} + e_t
    initial_state: str = "embedding"  # "embedding": s_1 = e_1 | "zero": s_1 = next_state(0, e_1)
    exit_dim: int = 0  # > 0: an input projection [s, h] -> exit_dim ahead of the blocks
    logits_top_k: int = 0  # > 0: only the k largest logits keep their value (the rest ~ -inf)

    @property
    def width(self) -> int:
        return self.llm_hidden_size + self.embed_size


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id), independent of dict order."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    vocab = inner.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


class DrafterHead(nn.Module):
    def __init__(self, config: DrafterConfig, draft_to_full: Optional[Union[Sequence[int], mx.array]] = None):
        super().__init__()
        self.config = config
        E, D, K = config.embed_size, config.llm_hidden_size, config.draft_vocab_size
        if config.recurrence == "rnn":
            self.U = nn.Linear(E, E, bias=False)
            self.W = nn.Linear(E, E, bias=True)  # its bias is b
        elif config.recurrence != "sum":
            raise ValueError(f"unknown drafter recurrence {config.recurrence!r}")
        if config.initial_state not in ("embedding", "zero"):
            raise ValueError(f"unknown drafter initial_state {config.initial_state!r}")
        F = config.exit_dim or D + E  # the blocks' width
        if config.exit_dim:
            self.input_proj = nn.Linear(D + E, F)
        self.blocks = [nn.Linear(F, F) for _ in range(config.num_blocks)]
        if config.output == "llm_head":
            self.to_hidden = nn.Linear(F, D)
            self._output_rows = None  # (K, D) the LLM's output rows: `attach_output_rows`
        elif config.output == "draft_vocab":
            self.proj = nn.Linear(F, K)
        else:
            raise ValueError(f"unknown drafter output {config.output!r}")
        if draft_to_full is None:
            if K != config.vocab_size:
                raise ValueError("draft_to_full is required when the draft vocabulary is not the full one")
            draft_to_full = mx.arange(K)
        self.set_draft_vocab(draft_to_full)

    # Underscore names keep the vocabulary maps out of `parameters()` (never trained).
    def set_draft_vocab(self, draft_to_full) -> None:
        d2f = mx.array(draft_to_full, dtype=mx.int32) if not isinstance(draft_to_full, mx.array) \
            else draft_to_full.astype(mx.int32)
        K, V = self.config.draft_vocab_size, self.config.vocab_size
        if d2f.shape != (K,):
            raise ValueError(f"draft_to_full has shape {d2f.shape}, expected ({K},)")
        f2d = mx.full((V,), -1, dtype=mx.int32)
        f2d[d2f] = mx.arange(K, dtype=mx.int32)
        self._draft_to_full = d2f
        self._full_to_draft = f2d

    @property
    def draft_to_full(self) -> mx.array:  # (K,) int32
        return self._draft_to_full

    @property
    def full_to_draft(self) -> mx.array:  # (V,) int32, -1 for tokens outside the draft vocabulary
        return self._full_to_draft

    def initial_state(self, token_embedding: mx.array) -> mx.array:
        if self.config.initial_state == "zero":
            return self.next_state(mx.zeros_like(token_embedding), token_embedding)
        return token_embedding  # s_1 = e_1   (..., E)

    def next_state(self, state: mx.array, token_embedding: mx.array) -> mx.array:
        if self.config.recurrence == "sum":
            return state + token_embedding
        return nn.silu(self.U(state) + self.W(token_embedding))  # (..., E)

    def attach_output_rows(self, rows: mx.array) -> None:
        """rows (K, D): the LLM's output-projection rows of the draft vocabulary (frozen)."""
        self._output_rows = rows

    def features(self, state: mx.array, hidden: mx.array) -> mx.array:
        if hidden.shape[:-1] != state.shape[:-1]:
            hidden = mx.broadcast_to(hidden, state.shape[:-1] + hidden.shape[-1:])
        g = mx.concatenate([state, hidden.astype(state.dtype)], axis=-1)  # (..., D+E)
        if self.config.exit_dim:
            g = self.input_proj(g)  # (..., F)
        for block in self.blocks:
            g = g + nn.silu(block(g))
        return g

    def predict_hidden(self, state: mx.array, hidden: mx.array) -> mx.array:
        """output="llm_head": the predicted next LLM hidden state (..., D)."""
        return self.to_hidden(self.features(state, hidden))

    def logits(self, state: mx.array, hidden: mx.array) -> mx.array:
        if self.config.output == "llm_head":
            if self._output_rows is None:
                raise ValueError("attach the LLM's output rows first (load_drafter does)")
            logits = self.predict_hidden(state, hidden) @ self._output_rows.T  # (..., K)
        else:
            logits = self.proj(self.features(state, hidden))  # (..., K)
        k = self.config.logits_top_k
        if 0 < k < logits.shape[-1]:
            # Apple's drafter keeps its top k (ties included) and sets the rest 50000 below the
            # largest, so that its beam scores are log-probabilities over those k tokens.
            kth = mx.min(mx.topk(logits, k, axis=-1), axis=-1, keepdims=True)
            floor = mx.max(logits, axis=-1, keepdims=True) - 50000.0
            logits = mx.where(logits < kth, floor, logits)
        return logits

    def num_params(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.size for _, v in tree_flatten(self.parameters()))


def llm_output_rows(lm, token_ids: mx.array) -> mx.array:
    """(K, D) float32 rows of the LLM's output projection for these token ids (dequantized)."""
    model = lm.model
    if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        rows = model.model.embed_tokens(token_ids)
    else:
        head = model.lm_head
        if isinstance(head, nn.QuantizedLinear):
            weight = mx.dequantize(head.weight, head.scales, head.biases, head.group_size, head.bits)
        else:
            weight = head.weight
        rows = weight[token_ids]
    return rows.astype(mx.float32)


def save_drafter(head: DrafterHead, directory, dtype=mx.float16) -> Path:
    """Write config.json + model.safetensors (weights in `dtype`, plus draft_to_full int32)."""
    from mlx.utils import tree_flatten

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(head.parameters())}
    weights["draft_to_full"] = head.draft_to_full
    mx.save_safetensors(str(directory / WEIGHTS_FILE), weights)
    (directory / CONFIG_FILE).write_text(json.dumps(asdict(head.config), indent=2) + "\n")
    return directory


def read_drafter_config(directory) -> DrafterConfig:
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise UserError(f"no drafter directory {directory}")
    if not path.exists():
        raise UserError(f"{directory} has no {CONFIG_FILE}: not a drafter directory")
    try:
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(DrafterConfig)}
        return DrafterConfig(**{k: v for k, v in raw.items() if k in known})
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
        raise UserError(f"corrupt drafter config {path}: {type(exc).__name__}") from None


def llm_shapes(lm) -> tuple:
    """(hidden size, embedding size, vocab size) of a LoadedModel."""
    args = lm.model.args
    hidden = int(args.hidden_size)
    vocab = int(args.vocab_size)
    return hidden, hidden, vocab  # Llama-family: token embeddings have the hidden size


def check_compatible(config: DrafterConfig, lm, where: str = "drafter") -> None:
    hidden, embed, vocab = llm_shapes(lm)
    name = lm.name
    if config.llm_hidden_size != hidden:
        raise DrafterMismatch(f"{where} was trained for hidden size {config.llm_hidden_size} "
                              f"({config.model_name or 'another model'}), but {name} has {hidden}")
    if config.embed_size != embed:
        raise DrafterMismatch(f"{where} expects embedding size {config.embed_size}, but {name} has {embed}")
    if config.vocab_size != vocab:
        raise DrafterMismatch(f"{where} was trained for vocabulary size {config.vocab_size} "
                              f"({config.model_name or 'another model'}), but {name} has {vocab}")
    if config.tokenizer_hash and config.tokenizer_hash != tokenizer_hash(lm.tokenizer):
        raise DrafterMismatch(f"{where} was trained with another tokenizer "
                              f"({config.model_name or 'unknown model'}) than {name}'s")


def load_drafter(directory, lm, dtype=mx.float32) -> DrafterHead:
    """Load a drafter for `lm`; refuses one trained for another model (DrafterMismatch)."""
    directory = Path(directory)
    config = read_drafter_config(directory)
    check_compatible(config, lm, where=f"drafter {directory}")
    path = directory / WEIGHTS_FILE
    if not path.exists():
        raise UserError(f"{directory} has no {WEIGHTS_FILE}")
    try:
        weights = mx.load(str(path))
    except Exception as exc:
        raise UserError(f"corrupt drafter weights {path}: {type(exc).__name__}") from None
    if "draft_to_full" not in weights:
        raise UserError(f"corrupt drafter weights {path}: no draft_to_full")
    head = DrafterHead(config, weights.pop("draft_to_full"))
    if config.output == "llm_head":
        head.attach_output_rows(llm_output_rows(lm, head.draft_to_full))
    try:
        head.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    except ValueError as exc:
        raise UserError(f"corrupt drafter weights {path}: {str(exc).splitlines()[0]}") from None
    mx.eval(head.parameters(), head.draft_to_full, head.full_to_draft, head._output_rows
            if config.output == "llm_head" else [])
    if dtype == mx.float32 and on_cpu() and current_layout(lm.model) == COLUMN:  # as the LLM's (model/cpu_layout.py)
        store_layout(head, COLUMN)
        if config.output == "llm_head":
            head.attach_output_rows(column_major(head._output_rows))
    return head
