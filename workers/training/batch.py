"""A trainer step's sequences as padded tensors, the slices of them one forward pass takes, and the check
that a group can go into a step at all."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from schemas import TrainGroup, WireTensor
from workers.engines.base import MediaInputs

if TYPE_CHECKING:
    from relax_bus.settings import StalenessConfig


@dataclass(frozen=True)
class Batch:
    """A step's N = B x n sequences as padded tensors (right padding), rows in group order."""

    ids: torch.Tensor  # [N, T] long
    attention: torch.Tensor  # [N, T] long
    mask: torch.Tensor  # [N, T-1] float, 1 on trained response tokens (aligned with token_logprobs); 0 on padding,
    # prompts and an episode's observation tokens
    rollout_logp: torch.Tensor  # [N, T-1] float
    ref_logp: torch.Tensor | None  # [N, T-1] float
    rewards: torch.Tensor  # [B, n] float
    lengths: tuple[int, ...]  # [N] prompt + response tokens of each row
    prompt_lengths: tuple[int, ...]  # [N] prompt tokens of each row
    group_of: tuple[int, ...]  # [N] the group (prompt) each row answers, 0..B-1
    routing: tuple[torch.Tensor, ...] = ()  # [N] x [len - 1, layers, k]: the rollout's routed experts (R3), or ()
    media: tuple[MediaInputs | None, ...] = ()  # [B] the processor tensors of each group's prompt, or ()
    valid: torch.Tensor | None = None  # [B, n] bool: False where the sample has no reward (its reward failed, or its
    # episode's environment); such a row's mask is all 0 and its advantage 0. None: all valid
    teacher_logp: torch.Tensor | None = None  # [N, T-1] float: the teacher's log-probs of the sampled tokens (a run
    # with a teacher), aligned with `mask`
    values: torch.Tensor | None = None  # [N, T-1] float: the critic's V(s_t) of the sampled tokens (a run with a
    # critic), aligned with `mask`

    def rows(self, rows: Sequence[int], device: torch.device) -> Batch:
        """The rows `rows` cut to their longest sequence, on `device` (rewards stay whole, on the CPU)."""
        index = torch.tensor(list(rows), dtype=torch.long)
        width = max(self.lengths[r] for r in rows)

        def cut(t: torch.Tensor, w: int) -> torch.Tensor:
            return t[index, :w].to(device)

        return Batch(
            ids=cut(self.ids, width),
            attention=cut(self.attention, width),
            mask=cut(self.mask, width - 1),
            rollout_logp=cut(self.rollout_logp, width - 1),
            ref_logp=None if self.ref_logp is None else cut(self.ref_logp, width - 1),
            rewards=self.rewards,
            lengths=tuple(self.lengths[r] for r in rows),
            prompt_lengths=tuple(self.prompt_lengths[r] for r in rows),
            group_of=tuple(self.group_of[r] for r in rows),
            routing=tuple(self.routing[r] for r in rows) if self.routing else (),
            media=self.media,
            valid=self.valid,
            teacher_logp=None if self.teacher_logp is None else cut(self.teacher_logp, width - 1),
            values=None if self.values is None else cut(self.values, width - 1),
        )


def make_batch(groups: Sequence[TrainGroup], media: Sequence[MediaInputs | None] = ()) -> Batch:
    """Pack B train groups of n samples each into padded tensors (with each group's media tensors, if given)."""
    rows: list[tuple[list[int], list[int], list[float]]] = []
    refs: list[list[float] | None] = []
    teachers: list[list[float] | None] = []
    critics: list[list[float] | None] = []
    rewards, group_of, routing, trained, valid = [], [], [], [], []
    for index, g in enumerate(groups):
        rollout = g.scored.rollout
        prompt = list(rollout.prompt_token_ids.to_values())
        rewards.append(list(g.scored.rewards))
        details = g.scored.details or tuple(None for _ in rollout.samples)
        valid.append([d is None or d.error is None for d in details])
        for i, s in enumerate(rollout.samples):
            routing.append(s.routed_experts)
            trained.append(s.trained() if s.loss_mask is not None else None)
            rows.append((prompt, list(s.token_ids.to_values()), list(s.logprobs.to_values())))  # type: ignore[arg-type]
            refs.append(_row(g.ref_logprobs, i))
            teachers.append(_row(g.teacher_logprobs, i))
            critics.append(_row(None if g.critic is None else g.critic.values, i))
            group_of.append(index)
    width = max(len(p) + len(r) for p, r, _ in rows)
    n = len(rows)
    ids = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width - 1)
    rollout_logp = torch.zeros(n, width - 1)
    ref_logp = torch.zeros(n, width - 1) if refs[0] is not None else None
    teacher_logp = torch.zeros(n, width - 1) if teachers[0] is not None else None
    values = torch.zeros(n, width - 1) if critics[0] is not None else None
    for row, (prompt, response, lps) in enumerate(rows):
        p, r = len(prompt), len(response)
        ids[row, : p + r] = torch.tensor(prompt + response)
        attention[row, : p + r] = 1
        # logit at position t predicts token t+1; an episode's observation tokens stay 0 (never trained)
        keep = trained[row]
        mask[row, p - 1 : p - 1 + r] = 1 if keep is None else torch.tensor(keep, dtype=mask.dtype)
        rollout_logp[row, p - 1 : p - 1 + r] = torch.tensor(lps)
        for into, per_token in ((ref_logp, refs[row]), (teacher_logp, teachers[row]), (values, critics[row])):
            if into is not None and per_token is not None:
                into[row, p - 1 : p - 1 + r] = torch.tensor(per_token)
    valid_rows = torch.tensor(valid, dtype=torch.bool)  # [B, n]
    mask *= valid_rows.reshape(-1, 1)  # a sample without a reward trains nothing
    return Batch(
        ids,
        attention,
        mask,
        rollout_logp,
        ref_logp,
        torch.tensor(rewards, dtype=torch.float32),
        tuple(len(p) + len(r) for p, r, _ in rows),
        tuple(len(p) for p, _, _ in rows),
        tuple(group_of),
        routed_rows(routing),
        tuple(media) or tuple(None for _ in groups),
        None if bool(valid_rows.all()) else valid_rows,
        teacher_logp,
        values,
    )


def _row(tensors: tuple[WireTensor, ...] | None, i: int) -> list[float] | None:
    """Sample i's values of a group's per-sample tensors (reference or teacher log-probs), None without them."""
    return None if tensors is None else list(tensors[i].to_values())  # type: ignore[arg-type]


def older_tokens(groups: Sequence[TrainGroup], batch: Batch, floor: int) -> torch.Tensor:
    """1 on the response tokens generated by a version older than `floor`, laid out as `batch.mask` ([N, T-1]):
    what `staleness.mask_stale_tokens` leaves out of the loss. Tokens without spans carry the group's version."""
    older = torch.zeros_like(batch.mask)
    row = 0
    for g in groups:
        rollout = g.scored.rollout
        for s in rollout.samples:
            spans = s.version_spans or ((rollout.policy_version, s.token_ids.numel),)
            at = batch.prompt_lengths[row] - 1
            for version, count in spans:
                if version < floor:
                    older[row, at : at + count] = 1
                at += count
            row += 1
    return older


def stale_masked(
    groups: Sequence[TrainGroup], batch: Batch, version: int | None, staleness: StalenessConfig
) -> tuple[Batch, dict[str, float]]:
    """`batch` with the tokens older than `version - max_staleness` masked out of the loss when
    `staleness.mask_stale_tokens` is on (and a bound and the version are known), and how many were masked."""
    bound = staleness.max_staleness
    if not staleness.mask_stale_tokens or bound is None or version is None:
        return batch, {}
    older = older_tokens(groups, batch, version - bound)
    return dataclasses.replace(batch, mask=batch.mask * (1 - older)), {"masked_stale_tokens": float(older.sum())}


def routed_rows(wire: Sequence[WireTensor | None]) -> tuple[torch.Tensor, ...]:
    """Every row's routed experts as [tokens, layers, k] integer tensors, decoded in one copy (views into it);
    () unless every row has routing of one dtype."""
    if not wire or any(t is None for t in wire) or len({t.dtype for t in wire if t is not None}) != 1:
        return ()
    tensors = [t for t in wire if t is not None]
    dtype = torch.uint8 if tensors[0].dtype == "uint8" else torch.int16
    flat = torch.frombuffer(bytearray(b"".join(t.data for t in tensors)), dtype=dtype)
    parts = flat.split([t.numel for t in tensors])
    return tuple(part.view(t.shape) for part, t in zip(parts, tensors, strict=True))


def routed_experts(t: WireTensor | None) -> torch.Tensor | None:
    """A sample's routed experts as a [tokens, layers, k] integer tensor (a copy: the wire bytes stay read-only)."""
    if t is None:
        return None
    dtype = torch.uint8 if t.dtype == "uint8" else torch.int16
    return torch.frombuffer(bytearray(t.data), dtype=dtype).view(t.shape)


def untrainable(group: TrainGroup, vocab_size: int, max_tokens: int | None = None) -> str | None:
    """Why a train group cannot go into a step, or None: a reward or log-prob that is not finite (one NaN
    would reach every weight), a token id outside the vocabulary, a prompt + response longer than the model's
    context (`max_tokens` positions; None: no limit), reference or teacher log-probs that do not line up with the
    responses, or an empty prompt."""
    scored, rollout = group.scored, group.scored.rollout
    if not all(math.isfinite(r) for r in scored.rewards):
        return f"reward not finite: {list(scored.rewards)}"
    prompt = rollout.prompt_token_ids.to_values()
    if not prompt:
        return "empty prompt token ids"
    if not _in_vocabulary(prompt, vocab_size):
        return f"prompt token id outside the vocabulary of {vocab_size}"
    for i, s in enumerate(rollout.samples):
        if not _in_vocabulary(s.token_ids.to_values(), vocab_size):
            return f"sample {i}: token id outside the vocabulary of {vocab_size}"
        if not _finite(s.logprobs):
            return f"sample {i}: rollout log-prob not finite"
        if max_tokens is not None and len(prompt) + s.token_ids.numel > max_tokens:
            return (
                f"sample {i}: {len(prompt)} prompt + {s.token_ids.numel} response tokens exceed the model's context "
                f"of {max_tokens} positions"
            )
    critic = None if group.critic is None else group.critic.values
    for name, tensors in (("reference", group.ref_logprobs), ("teacher", group.teacher_logprobs), ("critic", critic)):
        if tensors is None:
            continue
        if len(tensors) != len(rollout.samples):
            return f"{len(tensors)} {name} log-prob rows for {len(rollout.samples)} samples"
        for i, (values, s) in enumerate(zip(tensors, rollout.samples, strict=True)):
            if values.numel != s.token_ids.numel:
                return f"sample {i}: {values.numel} {name} log-probs for {s.token_ids.numel} tokens"
            if not _finite(values):
                return f"sample {i}: {name} log-prob not finite"
    return None


def _in_vocabulary(ids: list[float] | list[int], vocab_size: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)


def _finite(t: WireTensor) -> bool:
    return all(math.isfinite(v) for v in t.to_values())
