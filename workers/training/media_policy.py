"""The trainer's side of a multimodal policy: loading it with its processor, and log-probs of rows with media.

A directory with a processor config (`workers.omni.loading.is_multimodal`, e.g. `tiny-omni`) loads with its
processor; the trainer then scores every row through `workers.omni.logprobs.media_token_logprobs` (3-D
positions, media special tokens masked as the engine masks them), text rows included, and never through the
shared-prompt path. The processor tensors of a group (`MediaInputs`, computed by the actor from the prompt's
parts and checked against the rollout's prompt ids) are shared by the group's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.data.models import load_model, load_tokenizer
from workers.engines.base import MediaInputs
from workers.training.logprobs import padded_rows, response_slices, token_logprobs


def load_policy(model_dir: Path) -> tuple[nn.Module, Any, Any]:
    """The model (train mode is the caller's), its tokenizer, and a `MediaPrompter` for a multimodal one (else None)."""
    from workers.omni.loading import is_multimodal

    if not is_multimodal(model_dir):
        return load_model(model_dir), load_tokenizer(model_dir), None
    from workers.omni.loading import load_omni
    from workers.omni.logprobs import check_positions
    from workers.omni.prompts import MediaPrompter

    model, processor = load_omni(model_dir)
    check_positions(model)
    return model, processor.tokenizer, MediaPrompter(processor)


def rows_media(media: Sequence[MediaInputs | None], group_of: Sequence[int], device: torch.device) -> MediaInputs:
    """The batched media tensors of rows answering groups `group_of` (a group's tensors once per row), on `device`."""
    from workers.omni.logprobs import batch_media

    batched = batch_media([media[g] or {} for g in group_of])
    return {k: v.to(device) for k, v in batched.items()}


def media_rows_logprobs(
    model: nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    media: Sequence[MediaInputs | None],
    group_of: Sequence[int],
    temperature: float,
    prompt_lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """Token log-probs [rows, T-1] of a multimodal policy over rows `ids` whose groups' media is `media`; with
    `prompt_lengths`, each group's prompt is embedded once for all its rows (`workers.omni.group_forward`)."""
    if prompt_lengths is not None:
        from workers.omni.group_forward import grouped_media_logprobs

        return grouped_media_logprobs(model, ids, attention, media, group_of, prompt_lengths, temperature)
    return policy_token_logprobs(model, ids, attention, temperature, rows_media(media, group_of, ids.device))


def policy_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    media: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`token_logprobs` for a text policy; for a multimodal one, the same with the rows' media -> [B, T-1].

    `media` holds the rows' batched processor tensors (`workers.omni.logprobs.batch_media`); with it, the
    forward takes the media and 3-D positions and the media special tokens are masked to -inf, as the
    engine masks them while sampling (`workers.omni.logprobs.media_token_logprobs`).
    """
    if media is None:
        return token_logprobs(model, input_ids, attention_mask, temperature)
    from workers.omni.logprobs import media_token_logprobs  # the media stack only when a multimodal policy trains

    return media_token_logprobs(model, input_ids, attention_mask, media, temperature)


def media_response_logprobs(
    model: nn.Module,
    prompt: MediaInputs,
    responses: list[list[int]],
    temperature: float = 1.0,
    suppressed: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Log-probs of each response's tokens after one media prompt: one 1-D float32 tensor [len(response)] each.

    The responses share the prompt and its media: one right-padded batch of n rows, the media repeated n times.
    """
    from workers.omni.logprobs import batch_media, media_token_logprobs

    if not responses:
        return []
    prompt_ids = prompt["input_ids"][0].tolist()
    device = next(model.parameters()).device
    if (rows := padded_rows(prompt_ids, responses, device)) is None:
        return [torch.zeros(0, dtype=torch.float32, device=device) for _ in responses]
    ids, mask = rows
    media = batch_media([prompt] * len(responses))
    logps = media_token_logprobs(model, ids, mask, media, temperature, suppressed)  # [n, T-1]
    return response_slices(logps, len(prompt_ids), responses)
