"""How a trainer step's sequences are cut: mini-batches (one optimizer update each) and micro-batches (one
forward/backward each, gradients accumulated), with the loss normalised as over the whole mini-batch.

    rows of the step             N = groups_per_step x samples_per_group sequences, in group order
    mini-batches                 `trainer.mini_batches` contiguous, near-equal slices of the rows
    a rank's share               rank r takes the r-th contiguous slice of each mini-batch (FSDP2)
    micro-batches                the share packed by length, longest first, so that rows x longest
                                 <= `trainer.compute.micro_batch_tokens` padded tokens (a longer sequence alone)

Every micro-batch's loss is its sum over tokens (or sequences) divided by the count over the whole
mini-batch on every rank, times the world size (FSDP2 averages gradients over ranks): the accumulated
gradient then equals that of one pass over the mini-batch in one process, whatever the ranks hold.
Under FSDP2 each forward is a collective, so every rank runs as many micro-batches as the busiest one;
the others run empty ones (one padding token, loss multiplied by 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """One rank's passes over a mini-batch: its micro-batches (row indices of the step), then `padding` empty
    passes, so that every rank makes as many as the busiest (0 in one process)."""

    micro: list[list[int]]
    padding: int = 0

    @property
    def rows(self) -> list[int]:
        """Every row of this rank's micro-batches."""
        return [r for rows in self.micro for r in rows]


def split_even(n: int, parts: int) -> list[range]:
    """`parts` contiguous ranges covering 0..n-1 whose sizes differ by at most one (empty ones when n < parts)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def pack(lengths: Sequence[int], budget: int | None) -> list[list[int]]:
    """Indices into `lengths` grouped so that each group's rows x longest length is at most `budget`.

    Longest first (similar lengths share a micro-batch, little padding); a sequence longer than the
    budget goes alone. `budget` None: all in one group. No indices: no groups.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if budget is None:
        return [order] if order else []
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def pack_groups(lengths: Sequence[int], group_of: Sequence[int], budget: int | None) -> list[list[int]]:
    """As `pack`, but a group's rows stay together (the prompt-shared forward then sees few distinct prompts).

    Groups in order of their longest row, longest first; within a group, rows longest first. A micro-batch
    takes rows while rows x its longest row stays within `budget`, so a group larger than the budget is split.
    """
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_of):
        members.setdefault(g, []).append(i)
    order = [
        i
        for g in sorted(members, key=lambda g: (-max(lengths[i] for i in members[g]), g))
        for i in sorted(members[g], key=lambda i: (-lengths[i], i))
    ]
    if budget is None:
        return [order] if order else []
    out: list[list[int]] = []
    longest = 0
    for i in order:
        if out and (len(out[-1]) + 1) * max(longest, lengths[i]) <= budget:
            out[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            out.append([i])
            longest = lengths[i]
    return out
