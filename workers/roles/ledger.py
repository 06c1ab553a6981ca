"""The actor's ledger of settled prompt groups: what makes "trained exactly once" hold.

Delivery is at least once: a stage whose ack was lost with a server crash publishes again, and a
copy can land in the train stream under a new sequence. The ledger therefore remembers every
release index ever trained (as a set of ranges, compact because groups arrive nearly in order) and
every `group_id/attempt` dropped or requeued, for the whole run, and goes into each checkpoint.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class RangeSet:
    """A set of non-negative integers stored as sorted, disjoint, non-adjacent `[lo, hi)` ranges."""

    def __init__(self) -> None:
        self._los: list[int] = []
        self._his: list[int] = []

    def __contains__(self, value: int) -> bool:
        k = bisect.bisect_right(self._los, value) - 1
        return k >= 0 and value < self._his[k]

    def __len__(self) -> int:
        return sum(h - lo for lo, h in zip(self._los, self._his, strict=True))

    def add(self, value: int) -> None:
        """Insert `value`, merging it with the ranges it touches."""
        if value < 0:
            raise ValueError(f"RangeSet holds non-negative integers, got {value}")
        if value in self:
            return
        k = bisect.bisect_right(self._los, value)  # ranges [0, k) start at or below value
        joins_left = k > 0 and self._his[k - 1] == value
        joins_right = k < len(self._los) and self._los[k] == value + 1
        if joins_left and joins_right:
            self._his[k - 1] = self._his[k]
            del self._los[k], self._his[k]
        elif joins_left:
            self._his[k - 1] = value + 1
        elif joins_right:
            self._los[k] = value
        else:
            self._los.insert(k, value)
            self._his.insert(k, value + 1)

    def ranges(self) -> list[list[int]]:
        """The ranges as `[[lo, hi), ...]` (plain lists: what a checkpoint stores)."""
        return [[lo, hi] for lo, hi in zip(self._los, self._his, strict=True)]

    @classmethod
    def from_ranges(cls, ranges: Iterable[Iterable[int]]) -> RangeSet:
        """Rebuild from `ranges()` output (any order; overlapping or adjacent ranges are merged)."""
        out = cls()
        for lo, hi in sorted((int(a), int(b)) for a, b in ranges):
            if lo >= hi:
                continue
            if out._his and lo <= out._his[-1]:
                out._his[-1] = max(out._his[-1], hi)
            else:
                out._los.append(lo)
                out._his.append(hi)
        return out
