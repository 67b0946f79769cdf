"""Forkable KV cache: threads that share a prefix without copying it (APAR).

All threads' keys and values live in one slot pool per layer, (1, Hkv, capacity, Dh). A thread
is the list of slots on its path to the root; forking copies that list of slot ids, never the
keys and values behind them. Each slot counts the live threads whose path holds it; when a
thread is freed, slots no live thread needs go back to the free list and are reused by the next
tokens, so a finished thread's memory is released at once.

One decoding step can carry tokens of many threads: `begin_step(thread_ids)` allocates a slot
per new token and returns each token's position (its depth on its own path) and the mask that
lets it see exactly its path to the root (plus itself), which `forward` then uses.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn

from .. import masks
from ..host_traffic import to_device

GROW_STEP = 256


class _PoolLayerCache:
    def __init__(self, owner: "ForkableKVCache"):
        self.owner = owner
        self.keys: mx.array | None = None  # (1, Hkv, capacity, Dh)
        self.values: mx.array | None = None

    @property
    def offset(self) -> int:
        offset = self.owner._step_offset
        if offset is None:
            raise TypeError("this step's tokens do not sit at consecutive positions: pass explicit positions")
        return offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        owner = self.owner
        if self.keys is None or self.keys.shape[2] < owner.capacity:
            self._grow(keys, values, owner.capacity)
        if owner._step_run is not None:  # consecutive slots (the usual case): a plain slice update
            start, stop = owner._step_run
            self.keys[..., start:stop, :] = keys
            self.values[..., start:stop, :] = values
        else:
            index = owner._step_index
            self.keys[..., index, :] = keys
            self.values[..., index, :] = values
        used = owner.high_water
        return self.keys[..., :used, :], self.values[..., :used, :]

    def _grow(self, keys, values, capacity):
        B, H, _, Dk = keys.shape
        new_keys = mx.zeros((B, H, capacity, Dk), keys.dtype)
        new_values = mx.zeros((B, H, capacity, values.shape[3]), values.dtype)
        if self.keys is not None:
            old = self.keys.shape[2]
            new_keys[..., :old, :] = self.keys
            new_values[..., :old, :] = self.values
        self.keys, self.values = new_keys, new_values


class ForkableKVCache:
    def __init__(self, num_layers: int):
        self.layers = [_PoolLayerCache(self) for _ in range(num_layers)]
        self.paths: Dict[int, List[int]] = {}  # thread id -> slots on its path to the root
        self.refcount: List[int] = []  # per slot: live threads whose path holds it
        self.free_slots: List[int] = []  # released slots, reused before the pool grows
        self.capacity = 0
        self.high_water = 0  # slots [0, high_water) have ever been used
        # How the current step writes its slots: a run [start, stop) of consecutive slots, else an
        # index array (built once per step, not once per layer).
        self._step_run = None
        self._step_index = None
        # Set when the whole pool is one thread's path and the step only extends it:
        # the step's first position (a scalar RoPE offset, as a contiguous cache has).
        self._step_offset = None

    @classmethod
    def for_model(cls, model: nn.Module) -> "ForkableKVCache":
        return cls(len(model.model.layers))

    # -- threads -------------------------------------------------------------------------
    def new_thread(self, thread_id: int) -> None:
        if thread_id in self.paths:
            raise ValueError(f"thread {thread_id} exists")
        self.paths[thread_id] = []

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares the parent's whole current path (slot ids only, no KV copy)."""
        if child_id in self.paths:
            raise ValueError(f"thread {child_id} exists")
        path = list(self.paths[parent_id])
        for slot in path:
            self.refcount[slot] += 1
        self.paths[child_id] = path

    def free_thread(self, thread_id: int) -> None:
        """Release a finished thread: slots no other live thread sees become reusable."""
        for slot in self.paths.pop(thread_id):
            self.refcount[slot] -= 1
            if self.refcount[slot] == 0:
                self.free_slots.append(slot)

    def length(self, thread_id: int) -> int:
        return len(self.paths[thread_id])

    @property
    def live_slots(self) -> int:
        """Slots holding KV some live thread can see (memory actually in use)."""
        return self.high_water - len(self.free_slots)

    # -- one decoding step -----------------------------------------------------------------
    def begin_step(self, thread_ids: Sequence[int], allow_contiguous: bool = False):
        """Allocate one slot per new token; tokens of a thread are in order.

        Returns positions (1, L) and a boolean mask (1, 1, L, high_water) for `forward`.

        allow_contiguous: when the pool holds a single thread whose path holds every slot (before
        the first fork, or a thread left alone in a compact pool), the step is exactly a contiguous
        cache's; then return positions None (the layers' `offset` is the scalar start) and mask
        None for one token or "causal" for several. That skips the per-token RoPE and the mask,
        a few percent of a one-token step on the CPU.
        """
        slots, positions = [], []
        for tid in thread_ids:
            slot = self._allocate()
            positions.append(len(self.paths[tid]))
            self.paths[tid].append(slot)
            self.refcount[slot] += 1
            slots.append(slot)
        start = slots[0] if slots else self.high_water
        consecutive = slots == list(range(start, start + len(slots)))
        self._step_run = (start, start + len(slots)) if consecutive else None
        self._step_index = None if consecutive else to_device(slots, dtype=mx.int32)
        self._step_offset = None
        lone = (len(self.paths) == 1 and bool(slots) and start == positions[0]
                and start + len(slots) == self.high_water)  # an empty step is no thread's: not lone
        if allow_contiguous and consecutive and lone:
            # One live thread whose `start` earlier slots are distinct and all below `start` (the
            # new ones are the pool's top): they are exactly slots 0..start-1, so "every key up to
            # here" is its path, as in a contiguous cache.
            self._step_offset = start
            return None, (None if len(slots) == 1 else "causal")
        visible = [self.paths[tid][: self.paths[tid].index(slot) + 1]  # its path up to and including itself
                   for tid, slot in zip(thread_ids, slots)]
        return to_device(positions, dtype=mx.int32)[None], masks.path_mask(visible, self.high_water)

    def undo_step(self, thread_ids: Sequence[int]) -> None:
        """Take back the last `begin_step(thread_ids)`: each thread drops its newest slot and the
        slot is free again (what was written there is never visible: no path holds it)."""
        for tid in reversed(thread_ids):
            slot = self.paths[tid].pop()
            self.refcount[slot] -= 1
            if self.refcount[slot] == 0:
                self.free_slots.append(slot)

    def _allocate(self) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        slot = self.high_water
        self.high_water += 1
        self.refcount.append(0)
        if self.high_water > self.capacity:
            self.capacity = ((self.high_water + GROW_STEP - 1) // GROW_STEP) * GROW_STEP
        return slot
