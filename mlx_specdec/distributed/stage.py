"""One pipeline stage: a contiguous slice of the model's layers with its own KV cache, and the
loop a worker rank (every rank but the head) runs.

KV multibuffering. The runs in flight form one chain (each speculative micro-batch continues the
one before it: PipeInfer's "the next tree continues the previous tree", with trees one branch
wide), and every stage computes the runs in the order they were sent. So a stage's cache is the
canonical text followed by the in-flight runs' tokens in order: each run's entries sit in their
own slice of the buffer (its partition), a run sees the canonical text and the runs before it,
accepted entries become canonical where they lie (the "buffer swap" copies nothing), and a
rejection cuts the buffer back (`TRIM`, an ordered transaction behind the runs already sent). A
cancelled run writes nothing. Trees (more than one branch per run) would need the slot-pool
cache APAR uses (`cache/forkable.py`); chains need none, and measure no copies at all.

Worker loop, per message in arrival order:
    RUN      cancelled: forward a SKIPPED stub (message order stays whole, no compute, no KV);
             else check its start position against the cache, run the slice, send the
             activations on, or, on the last stage, the results the head asked for
    CANCEL   (acted on at arrival, in the receiver thread) record the run ids, pass it on
    TRIM     cut the cache to the canonical length, pass it on
    HELLO    add this rank's model fingerprint, pass it on
    STOP     pass it on, end
"""

from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np

from ..cache import ContiguousKVCache
from ..model.forward import lm_head, transformer_block
from .link import CANCEL, ERROR, HELLO, RESULT, RUN, SKIPPED, STOP, TRIM, Inbox, Message, Outbox, RankFailure, \
    text_payload


class StageModel:
    """Layers `layers` of `model`; the other layers' weights are dropped from this process."""

    def __init__(self, model, layers: range):
        inner = model.model
        total = len(inner.layers)
        self.model, self.span = model, layers
        self.first, self.last = layers.start == 0, layers.stop == total
        self.hidden_size = inner.embed_tokens.weight.shape[1]
        self.vocab = inner.embed_tokens.weight.shape[0]
        self.fingerprint = model_fingerprint(model)  # of the whole model, before the drop
        inner.layers = [inner.layers[i] for i in layers]
        if not self.first and not self.last:  # neither embeds tokens nor projects to the vocabulary
            inner.embed_tokens = None
        mx.clear_cache()
        self.cache = ContiguousKVCache.for_model(model)

    def parameter_bytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def run(self, x: mx.array, stop: Optional[Callable[[], bool]] = None, every: int = 5) -> Optional[mx.array]:
        """x: token ids (1, T) on the first stage, else activations (1, T, D) -> (1, T, D).
        With `stop`, the layers are computed `every` at a time and the run is abandoned (None)
        as soon as stop() says so (a cancelled run: the paper's abort at thread-sync points); the
        layers it reached keep entries past the others', which the cancellation's TRIM removes."""
        inner = self.model.model
        h = inner.embed_tokens(x) if self.first else x
        mask = "causal" if h.shape[1] > 1 else None
        count = len(inner.layers)
        for i, (layer, layer_cache) in enumerate(zip(inner.layers, self.cache.layers)):
            h = transformer_block(layer, h, None, layer_cache, mask)
            if stop is not None and (i + 1) % every == 0 and i + 1 < count:
                mx.eval(h)  # host sync: a checkpoint where a cancelled run stops
                if stop():
                    return None
        return h

    def truncate(self, length: int) -> None:
        """Every layer's cache back to at most `length` entries (an abandoned run left some
        layers longer than others)."""
        for layer in self.cache.layers:
            layer.offset = min(layer.offset, length)

    def results(self, h: mx.array, want_from: int, want_hidden: bool, want_logits: bool) -> mx.array:
        """The last stage's answer for tokens want_from.. of a run: (K, 1 + [D]) float32 rows of
        [argmax id, hidden...] when greedy, (K, V + [D]) of [logits, hidden...] when sampling."""
        hidden = self.model.model.norm(h[0, want_from:])  # (K, D)
        logits = lm_head(self.model, hidden).astype(mx.float32)  # (K, V)
        head = logits if want_logits else mx.argmax(logits, axis=-1).astype(mx.float32)[:, None]
        return mx.concatenate([head, hidden.astype(mx.float32)], axis=1) if want_hidden else head


def cache_checksum(cache, length: int) -> int:
    """Sum of |keys| + |values| over the first `length` positions of every layer, x 1000."""
    total = sum(mx.sum(mx.abs(layer.keys[..., :length, :])) + mx.sum(mx.abs(layer.values[..., :length, :]))
                for layer in cache.layers)
    return int(float(total.item()) * 1000)


def model_fingerprint(model) -> List[int]:
    """Layers, width, vocabulary, and a checksum of one weight: ranks that loaded different
    models (or quantizations) disagree here."""
    inner = model.model
    probe = inner.layers[0].self_attn.o_proj
    weight = getattr(probe, "weight")
    checksum = float(mx.sum(mx.abs(weight.astype(mx.float32))).item()) if weight.dtype != mx.uint32 else \
        float(mx.sum(weight.astype(mx.float32) % 9973).item())
    return [len(inner.layers), inner.embed_tokens.weight.shape[1], inner.embed_tokens.weight.shape[0],
            int(checksum * 1000) % (2 ** 31 - 1)]


def serve_stage(stage: StageModel, group, rank: int, ranks: int, idle_timeout: float,
                latency_ms: float = 0.0, gbps: float = 0.0) -> None:
    """A worker rank's loop: receive from rank - 1, send to rank + 1 (the last rank sends to
    the head, rank 0: its ring neighbour)."""
    after = (rank + 1) % ranks
    outbox = Outbox(group, after, latency_ms, gbps)
    cancelled = set()
    lock = threading.Lock()

    def on_arrival(message: Message) -> bool:
        if message.kind != CANCEL:
            return False
        with lock:
            cancelled.update(range(message.a, message.b + 1))
        if not stage.last:  # on at once, overtaking the runs this stage has not passed on yet
            outbox.send(message)
        return True

    inbox = Inbox(group, rank - 1, on_arrival)
    busy = 0.0
    try:
        while True:
            message = inbox.get(idle_timeout)
            if message.kind == RUN:
                with lock:
                    skip = message.run in cancelled
                if skip:
                    outbox.send(Message(SKIPPED, message.run, message.count, message.start))
                    continue
                if message.start != stage.cache.offset:
                    raise RankFailure(f"rank {rank}: run {message.run} starts at {message.start}, "
                                      f"its cache holds {stage.cache.offset} tokens (out of order)")
                begin = time.perf_counter()
                x = message.payload.astype(mx.int32) if stage.first else message.payload
                run_id = message.run

                def stop() -> bool:
                    with lock:
                        return run_id in cancelled

                h = stage.run(x, stop)
                if h is None:  # cancelled while it ran
                    busy += time.perf_counter() - begin
                    outbox.send(Message(SKIPPED, message.run, message.count, message.start))
                    continue
                if stage.last:
                    rows = None if message.a >= message.count else \
                        stage.results(h, message.a, bool(message.b & 1), bool(message.b & 2))  # none: a prefill chunk
                    out = Message(RESULT, message.run, message.count, message.start, message.a, message.b, rows)
                else:
                    out = Message(RUN, message.run, message.count, message.start, message.a, message.b,
                                  h.astype(mx.float32))
                mx.eval(h if out.payload is None else out.payload)  # host sync: the run's compute, timed
                busy += time.perf_counter() - begin
                outbox.send(out)
            elif message.kind == TRIM:
                stage.truncate(message.b)
                if not stage.last:
                    outbox.send(message)
            elif message.kind == HELLO:  # a = 0: the handshake; 1: busy time since the last report;
                # 2: a checksum of the cache's first b entries (tests: cancelled runs left no trace)
                if message.a == 2:
                    mine = [cache_checksum(stage.cache, message.b)]
                elif message.a == 1:
                    mine, busy = [int(busy * 1e6)], 0.0
                else:
                    mine = stage.fingerprint + [stage.parameter_bytes() // 1024]
                prints = np.array(message.payload).reshape(-1).tolist() + mine
                outbox.send(Message(HELLO, a=message.a, payload=mx.array(prints, dtype=mx.int32)))
            elif message.kind == STOP:
                if not stage.last:
                    outbox.send(message)
                return
    except Exception as error:  # noqa: BLE001  (reported on the head as one line)
        line = str(error) if isinstance(error, RankFailure) else f"rank {rank}: {type(error).__name__}: {error}"
        try:
            outbox.send(Message(ERROR, payload=text_payload(line)))
        except RankFailure:
            pass
        raise
    finally:
        outbox.close()
