"""Repetition penalties on the target's logits: the one place their math lives.

Applied to the raw logits before the temperature and top-p (`acceptance.sampling_logits`), and
before the argmax when greedy: they change what the target itself would write, so every lossless
method applies them exactly where `ar` does, and a speculative method to each verified node with
that node's own text.

    repetition (mlx-lm's `make_repetition_penalty`): every distinct token t among the last
        `repetition_context_size` tokens of prompt + answer: logit < 0 -> logit * r, else logit / r
    presence, frequency (OpenAI's): logit[t] -= p * [count(t) > 0] + f * count(t), count(t) = the
        times t was written in the answer so far (the prompt is not counted)

in that order (mlx-lm's `make_logits_processors`: repetition, presence, frequency). All lazy
MLX graphs; with every penalty off (`Penalties.of` returns None) no method calls anything here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .errors import UserError

#: the GenerationParams fields that are penalties, and the value that turns each off
OFF = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
#: methods that apply them (exactly as below; `mlx-lm` by mlx-lm's own processors, and `auto` picks ar or
#: redrafter); the others refuse a request that sets one
SUPPORTED = ("ar", "mlx-lm", "redrafter", "triforce", "auto", "pp-ar", "pp-spec", "pipeinfer")


class Unsupported(UserError):
    """A sampling field the chosen method cannot apply: a usage error (the CLI exits 2)."""

    exit_status = 2

    def __init__(self, param: str, method: str):
        super().__init__(f"{param}: not supported by {method}")
        self.param = param


def requested(params) -> List[str]:
    """The penalty fields `params` turns on."""
    return [name for name, off in OFF.items() if getattr(params, name, off) != off]


def check_method(method: str, params) -> None:
    """Refuse (one line, naming the field) a penalty the method does not apply: `mlx-lm` runs
    mlx-lm's own processors, so a penalty the installed mlx-lm lacks is refused too."""
    wanted = requested(params)
    if wanted and method not in SUPPORTED:
        raise Unsupported(wanted[0], method)
    if wanted and method == "mlx-lm":
        import inspect

        import mlx_lm
        from mlx_lm.sample_utils import make_logits_processors

        takes = inspect.signature(make_logits_processors).parameters
        for name in wanted:
            if name not in takes:
                raise Unsupported(name, f"mlx-lm {getattr(mlx_lm, '__version__', '')}".strip())


@dataclass(frozen=True)
class Penalties:
    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    window: int = 20  # repetition_context_size

    @classmethod
    def of(cls, params) -> Optional["Penalties"]:
        """The params' penalties, or None when every one is off."""
        if not requested(params):
            return None
        return cls(float(params.frequency_penalty), float(params.presence_penalty),
                   float(params.repetition_penalty), int(params.repetition_context_size))

    @property
    def counts(self) -> bool:  # needs the answer's token counts
        return self.frequency != 0.0 or self.presence != 0.0

    @property
    def recent(self) -> bool:  # needs the last `window` tokens
        return self.repetition != 1.0


def penalize(logits: mx.array, pen: Penalties, counts: Optional[mx.array], recent: Optional[mx.array]) -> mx.array:
    """logits (..., V); counts (..., V) (broadcast): the answer's count of each token; recent
    (..., K) int: the repetition window's token ids (a token may repeat: it is penalized once)."""
    if pen.recent:
        chosen = mx.take_along_axis(logits, recent, axis=-1)
        chosen = mx.where(chosen < 0, chosen * pen.repetition, chosen / pen.repetition)
        logits = mx.put_along_axis(logits, recent, chosen.astype(logits.dtype), axis=-1)
    if pen.presence != 0.0:
        logits = logits - pen.presence * (counts > 0).astype(logits.dtype)
    if pen.frequency != 0.0:
        logits = logits - pen.frequency * counts.astype(logits.dtype)
    return logits


def window_of(tokens: Sequence[int], size: int) -> np.ndarray:
    """The last `size` tokens, front-padded by repeating the first (a repeat changes nothing)."""
    tail = list(tokens[-size:])
    return np.array([tail[0]] * (size - len(tail)) + tail, dtype=np.int32)


class History:
    """One sequence's penalty state on the device, updated lazily (`ar`'s pipelined loop never
    waits for it): the answer's token counts and the repetition window."""

    def __init__(self, pen: Penalties, prompt: Sequence[int]):
        self.pen = pen
        self.counts: Optional[mx.array] = None  # (1, V), made at the first logits
        self.recent = mx.array(window_of(prompt, pen.window))[None] if pen.recent else None

    def __call__(self, logits: mx.array) -> mx.array:  # (1, V) -> (1, V), penalized
        if self.pen.counts and self.counts is None:
            self.counts = mx.zeros(logits.shape, dtype=mx.float32)
        return penalize(logits, self.pen, self.counts, self.recent)

    def add(self, token: mx.array) -> None:  # token (1,): the next token of the answer
        if self.counts is not None:
            self.counts = self.counts + (mx.arange(self.counts.shape[-1])[None] == token[:, None])
        if self.recent is not None:
            self.recent = mx.concatenate([self.recent[:, 1:], token[:, None].astype(mx.int32)], axis=1)


class TreePenalties:
    """A batch of rows whose every verified node is penalized by its own text: the prompt, the
    answer so far (its own token last), then the drafts on the node's path, the node's own last.
    The answer's counts (B, V) stay on the device; a node's path adds a scatter of its few drafts."""

    def __init__(self, pen: Penalties, prompts: Sequence[Sequence[int]], vocab: int):
        self.pen, self.vocab = pen, vocab
        self.counts = mx.zeros((len(prompts), vocab), dtype=mx.float32)
        self.recent = np.stack([window_of(p, pen.window) for p in prompts]) if len(prompts) else \
            np.zeros((0, pen.window), dtype=np.int32)  # (B, K) host

    def first(self, logits: mx.array) -> mx.array:  # (B, V) after the prompt alone
        return penalize(logits, self.pen, self.counts, mx.array(self.recent))

    def nodes(self, logits: mx.array, beams: np.ndarray, packed) -> mx.array:
        """logits (B, N, V) at the packed tree's nodes; beams (B, W, L) with the own token at
        depth 0; packed: each row's PackedTree (its `index` maps (w, j) to a node)."""
        B, N, _ = logits.shape
        W, L = beams.shape[1:]
        where = np.zeros((B, N), dtype=np.int64)  # a (w, j) of each node: its path is beams[w, 1 : j + 1]
        for b, tree in enumerate(packed):
            # Only a (w, j) at its node's own depth spells the node's path: a runner-up's beam points
            # its padding past the runner (and an unverified runner's whole beam) at a shallower node.
            own = np.arange(L) == tree.depths[tree.index]  # (W, L)
            where[b, tree.index[own]] = np.flatnonzero(own)
        beam, depth = where // L, where % L
        path = np.take_along_axis(beams[:, :, 1:], beam[..., None], axis=1)  # (B, N, L-1)
        on_path = np.arange(L - 1) < depth[..., None]  # (B, N, L-1)
        counts = recent = None
        if self.pen.counts and L == 1:  # a plain step: no drafts on any path
            counts = self.counts[:, None, :]
        elif self.pen.counts:
            rows = np.broadcast_to(np.arange(B)[:, None, None], path.shape)
            nodes = np.broadcast_to(np.arange(N)[None, :, None], path.shape)
            extra = mx.zeros((B, N, self.vocab), dtype=mx.float32).at[
                mx.array(rows), mx.array(nodes), mx.array(path)].add(mx.array(on_path, dtype=mx.float32))
            counts = self.counts[:, None, :] + extra
        if self.pen.recent:
            recent = mx.array(self._windows(path, on_path, depth))
        return penalize(logits, self.pen, counts, recent)

    def _windows(self, path: np.ndarray, on_path: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """(B, N, K + L-1) each node's window ids: the row's last K tokens then the node's path,
        where the K before the node's last are kept and every other entry repeats the node's last."""
        K = self.pen.window
        seq = np.concatenate([np.broadcast_to(self.recent[:, None, :], path.shape[:2] + (K,)), path], axis=-1)
        position = np.arange(K + path.shape[-1])  # in seq; the node's last token is at K - 1 + depth
        last = K - 1 + depth[..., None]
        kept = (position > last - K) & (position <= last)
        ends = np.take_along_axis(seq, last, axis=-1)
        return np.where(kept, seq, ends).astype(np.int32)

    def commit(self, new_tokens: Sequence[Sequence[int]]) -> None:
        """Each row's tokens written this step (its next own token last)."""
        rows = [b for b, tokens in enumerate(new_tokens) for _ in tokens]
        flat = [t for tokens in new_tokens for t in tokens]
        if flat:
            self.counts = self.counts.at[mx.array(rows), mx.array(flat)].add(1.0)
        K = self.pen.window
        self.recent = np.stack([np.concatenate([self.recent[b], np.array(t, dtype=np.int32)])[-K:]
                                for b, t in enumerate(new_tokens)])

    def select_rows(self, keep: np.ndarray) -> None:
        self.counts, self.recent = self.counts[mx.array(keep)], self.recent[keep]

    def add_row(self, text: Sequence[int]) -> None:
        """A row joining a running batch whose own token is `text`'s last: no answer yet."""
        self.counts = mx.concatenate([self.counts, mx.zeros((1, self.vocab), dtype=mx.float32)])
        self.recent = np.concatenate([self.recent, window_of(text, self.pen.window)[None]])


class DeviceTreePenalties:
    """`TreePenalties` with nothing uploaded per step (the device step, redrafter_device.py): each
    node's path is read off the packed tree on the device (its tokens, ancestor mask and depths),
    and the answer's counts and repetition window are updated from the accepted path and the next
    token where the accept left them. The same penalized logits, node for node."""

    def __init__(self, host: TreePenalties):
        self.pen, self.vocab = host.pen, host.vocab
        self.counts = host.counts  # (B, V) on the device
        self.recent = mx.array(host.recent)  # (B, K): one upload, when the device step takes over

    def on_tree(self, logits: mx.array, tokens: mx.array, mask: mx.array, depths: mx.array,
                length: int) -> mx.array:
        """logits (B, n, V) at the packed nodes; tokens (B, n), mask (B, 1, n, n) ancestor-or-self,
        depths (B, n); length: the beams' padded length (a node is at most length - 1 deep)."""
        B, n, _ = logits.shape
        if length == 1:  # a plain step: no drafts on any path
            return penalize(logits, self.pen, self.counts[:, None, :], self._windows(self._no_path(B, n), depths))
        k = mx.arange(1, length)  # (L-1,) the depths a path holds
        at_depth = mask[:, 0, :, :, None] & (depths[:, None, :, None] == k)  # (B, n, n, L-1): j on i's path at k
        path = (at_depth * tokens[:, None, :, None]).sum(axis=2)  # (B, n, L-1) i's drafts by depth, 0 past it
        on_path = k <= depths[..., None]  # (B, n, L-1)
        counts = None
        if self.pen.counts:
            rows = mx.broadcast_to(mx.arange(B)[:, None, None], path.shape)
            nodes = mx.broadcast_to(mx.arange(n)[None, :, None], path.shape)
            extra = mx.zeros((B, n, self.vocab), dtype=mx.float32).at[rows, nodes, path].add(
                on_path.astype(mx.float32))
            counts = self.counts[:, None, :] + extra
        return penalize(logits, self.pen, counts, self._windows(path, depths) if self.pen.recent else None)

    @staticmethod
    def _no_path(B: int, n: int) -> mx.array:
        return mx.zeros((B, n, 0), dtype=mx.int32)

    def _windows(self, path: mx.array, depths: mx.array) -> Optional[mx.array]:
        """As `TreePenalties._windows`, on the device."""
        if not self.pen.recent:
            return None
        K = self.pen.window
        B, n, _ = path.shape
        seq = mx.concatenate([mx.broadcast_to(self.recent[:, None, :], (B, n, K)), path.astype(mx.int32)], axis=-1)
        position = mx.arange(seq.shape[-1])
        last = K - 1 + depths[..., None]  # (B, n, 1) the node's own last token in seq
        kept = (position > last - K) & (position <= last)
        return mx.where(kept, seq, mx.take_along_axis(seq, last, axis=-1)).astype(mx.int32)

    def commit_accepted(self, beams: mx.array, beam: mx.array, accepted: mx.array, token: mx.array) -> None:
        """beams (B, Wb, Lb) the step's, the own token first; beam, accepted, token (B,) the accept's:
        each row wrote beams[beam, 1 : accepted + 1], then token."""
        B, _, Lb = beams.shape
        chosen = mx.take_along_axis(beams, beam[:, None, None].astype(mx.int32), axis=1)[:, 0]  # (B, Lb)
        written = mx.concatenate([chosen[:, 1:], mx.zeros((B, 1), dtype=mx.int32)], axis=1)
        at = mx.arange(Lb)[None]
        written = mx.where(at == accepted[:, None], token[:, None].astype(mx.int32), written)
        valid = at <= accepted[:, None]  # (B, Lb)
        written = mx.where(valid, written, 0)  # padding drafts are -1: never an index
        if self.pen.counts:
            rows = mx.broadcast_to(mx.arange(B)[:, None], written.shape)
            self.counts = self.counts.at[rows, written].add(valid.astype(mx.float32))
        if self.pen.recent:
            seq = mx.concatenate([self.recent, written], axis=1)  # (B, K + Lb)
            start = (accepted + 1).astype(mx.int32)[:, None]
            self.recent = mx.take_along_axis(seq, start + mx.arange(self.pen.window)[None], axis=1)

    def commit(self, new_tokens) -> None:
        """Nothing: `commit_accepted` keeps the state from what the device holds."""

    def select_rows(self, keep: np.ndarray) -> None:
        keep = mx.array(keep)
        self.counts, self.recent = self.counts[keep], self.recent[keep]


class NoPenalties:
    """Every penalty off: the logits go through untouched and nothing is kept."""

    def first(self, logits):
        return logits

    def nodes(self, logits, beams, packed):
        return logits

    def on_tree(self, logits, tokens, mask, depths, length):
        return logits

    def commit_accepted(self, beams, beam, accepted, token) -> None:
        pass

    def commit(self, new_tokens) -> None:
        pass

    def select_rows(self, keep) -> None:
        pass

    def add_row(self, text) -> None:
        pass


class _Chain:
    """A chain of L tokens as `TreePenalties.nodes` sees a packed tree: node j is (beam 0, depth j)."""

    def __init__(self, length: int):
        self.index = np.arange(length)[None]  # (W = 1, L)
        self.depths = np.arange(length)


class ChainPenalties:
    """One sequence verified a chain at a time (TriForce's two levels): in a verify of `fed`, the
    position that writes the token after fed[j] is penalized by its own text, `text` (the prompt
    and the answer so far, fed[0] last) then fed[1 : j + 1]. The counts come from `text` each time,
    so a level that drops what it wrote (a rejected round) has nothing to undo."""

    def __init__(self, pen: Penalties, prompt_length: int, vocab: int):
        self.pen, self.prompt_length, self.vocab = pen, prompt_length, vocab

    def _tree(self, text: Sequence[int]) -> TreePenalties:
        tree = TreePenalties(self.pen, [text], self.vocab)
        if self.pen.counts:
            answer = np.asarray(text[self.prompt_length:], dtype=np.int64)
            tree.counts = mx.array(np.bincount(answer, minlength=self.vocab)[None].astype(np.float32))
        return tree

    def first(self, logits: mx.array, text: Sequence[int]) -> mx.array:
        """logits (1, V) after `text` with nothing drafted (the prompt's last position)."""
        return self._tree(text).first(logits)

    def chain(self, logits: mx.array, text: Sequence[int], fed: Sequence[int]) -> mx.array:
        """logits (1, k + 1, V) of a forward of `fed` after `text` (which ends with fed[0])."""
        return self._tree(text).nodes(logits, np.array([[list(fed)]]), [_Chain(len(fed))])


def for_chain(params, prompt_length: int, vocab: int) -> Optional[ChainPenalties]:
    pen = Penalties.of(params)
    return None if pen is None else ChainPenalties(pen, prompt_length, vocab)


def for_rows(params, prompts: Sequence[Sequence[int]], vocab: int):
    pen = Penalties.of(params)
    return NoPenalties() if pen is None else TreePenalties(pen, prompts, vocab)
