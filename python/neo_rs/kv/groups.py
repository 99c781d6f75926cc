"""KV cache groups (vLLM's hybrid KV cache manager): layers that share a block table. A model
whose layers all attend alike (globally, or all within one window) has one group holding every
layer. A hybrid model (Gemma 2/3: sliding layers beside global ones) has several of equal size:
each kind's layers split into groups of as many layers as the rarest kind has, the last one
short where they do not divide. The pools' layer axis then has one slot per layer of a group:
a block holds its group's layers, slot by slot, so a sliding group's blocks behind its window
go back to the pool shared by every group while the global groups keep all of theirs. The
scheduler keeps a table entry per group per block of tokens (``kv_group_windows``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class KvGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: global)
    group: tuple[int, ...]  # per layer: its group
    slot: tuple[int, ...]  # per layer: its index on the pools' layer axis

    @staticmethod
    def of(windows: list[int | None]) -> KvGroups:
        """Groups of layers whose windows are ``windows`` (one per layer)."""
        kinds = sorted(set(windows), key=windows.index)
        if len(kinds) == 1:
            return KvGroups((kinds[0],), (0,) * len(windows), tuple(range(len(windows))))
        layers = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
        size = min(len(ls) for ls in layers.values())
        chunks = [(w, ls[i : i + size]) for w, ls in layers.items() for i in range(0, len(ls), size)]
        chunks.sort(key=lambda c: c[1][0])  # groups in the order of their first layer
        group, slot = [0] * len(windows), [0] * len(windows)
        for g, (_, ls) in enumerate(chunks):
            for s, i in enumerate(ls):
                group[i], slot[i] = g, s
        return KvGroups(tuple(w for w, _ in chunks), tuple(group), tuple(slot))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """The pools' layer axis: the layers of the largest group."""
        return max(self.slot) + 1

    def first_writer(self, layer: int) -> bool:
        """Whether ``layer`` is the first to write its slot (copies into it go before)."""
        return self._writers[0][self.slot[layer]] == layer

    def last_writer(self, layer: int) -> bool:
        """Whether ``layer`` is the last to write its slot (copies out of it go after)."""
        return self._writers[1][self.slot[layer]] == layer

    @cached_property
    def _writers(self) -> tuple[list[int], list[int]]:
        """Per slot, its first and last writing layer (asked at every layer of an iteration)."""
        first, last = [-1] * self.num_slots, [-1] * self.num_slots
        for layer, slot in enumerate(self.slot):
            if first[slot] < 0:
                first[slot] = layer
            last[slot] = layer
        return first, last
