"""Teacher-forced log-probs of a multimodal policy, with the processor's media tensors and M-RoPE positions.

The same quantity as `workers.training.logprobs.token_logprobs`, `log_softmax(logits[t] / tau)[x[t+1]]`,
except that the media special tokens (image/video/audio pads and their begin/end markers) are set to -inf
before the softmax, exactly as the engine suppresses them while sampling: the engine reports log-probs
under that masked distribution, so the trainer must score under it too. A target that is itself a media
token (only inside prompts) gets log-prob 0, as pads do.

Positions are the Qwen2.5-Omni 3-D rotary positions (`get_rope_index`: temporal, height, width per media
token; text continues after the largest media position). A response token's position is the previous
position + 1, so teacher-forced positions over prompt + response equal the positions the engine fed while
decoding. Media tensors of several prompts are batched with `batch_media`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from workers.omni.errors import UnsupportedModelError
from workers.omni.inputs import MediaInputs

MEDIA_TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
    "vision_token_id",
)
"""Config attributes naming the media special tokens a policy must never sample."""


def media_tensors(inputs: MediaInputs) -> MediaInputs:
    """The tensors of `inputs` other than the token ids and their mask: what the forward takes besides them."""
    return {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}


def media_token_ids(config: object) -> list[int]:
    """The media special-token ids named by a model config (empty for a text-only model)."""
    found = {getattr(config, name, None) for name in MEDIA_TOKEN_FIELDS}
    return sorted(i for i in found if isinstance(i, int))


def mask_tokens(logits: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """`logits` [..., V] with the columns `token_ids` set to -inf (unchanged when there are none)."""
    if token_ids is None or token_ids.numel() == 0:
        return logits
    return logits.index_fill(-1, token_ids.to(logits.device), float("-inf"))


def check_positions(model: nn.Module) -> None:
    """Raise UnsupportedModelError unless the model's 3-D position rule is wired here (the Qwen2.5-Omni thinker)."""
    if getattr(model, "get_rope_index", None) is None or "qwen2_5_omni" not in str(model.config.model_type):
        raise UnsupportedModelError(
            f"multimodal positions are wired for the Qwen2.5-Omni thinker only, not {type(model).__name__}"
        )


def rope_positions(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: MediaInputs
) -> torch.Tensor:
    """The 3-D rotary positions [3, B, T] of the sequences `input_ids` [B, T] with their media tensors."""
    check_positions(model)
    get_rope_index = model.get_rope_index
    fam = media.get("feature_attention_mask")
    positions, _ = get_rope_index(
        input_ids,
        media.get("image_grid_thw"),
        media.get("video_grid_thw"),
        attention_mask,
        False,
        fam.sum(-1) if fam is not None else None,
        media.get("video_second_per_grid"),
    )
    return positions  # type: ignore[no-any-return]


def batch_media(items: Sequence[MediaInputs]) -> MediaInputs:
    """Concatenate the media tensors of several prompts (in row order) for one batched forward.

    Patches and grids are concatenated along their first dim; audio features [1, mels, frames] are padded
    with zeros (and a 0 feature mask) to the longest clip, which the audio tower ignores.
    """
    out: MediaInputs = {}
    keys = sorted({k for item in items for k in media_tensors(item)})
    for key in keys:
        parts = [item[key] for item in items if key in item]
        if key in ("input_features", "feature_attention_mask"):
            width = max(p.shape[-1] for p in parts)
            parts = [nn.functional.pad(p, (0, width - p.shape[-1])) for p in parts]
        if key == "video_second_per_grid":
            parts = [p.reshape(-1) for p in parts]
        out[key] = torch.cat(parts, dim=0)
    return out


def media_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: MediaInputs,
    temperature: float = 1.0,
    suppressed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-prob of each next token under the media-masked tempered distribution -> [B, T-1] float32, 0 at pads.

    `media` holds the batched media tensors of the rows (`batch_media`); `suppressed` the token ids masked
    to -inf (default: the config's media tokens).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if suppressed is None:
        suppressed = torch.tensor(media_token_ids(model.config), dtype=torch.long)
    mask = attention_mask.long()  # [B, T]
    media = media_tensors(media)  # a prompt's whole processor output may be passed: its ids are not the rows'
    positions = rope_positions(model, input_ids, mask, media)  # [3, B, T]
    logits: torch.Tensor = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False, **media
    ).logits
    return scored_logprobs(logits, input_ids, mask, temperature, suppressed)


def scored_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor, temperature: float, suppressed: torch.Tensor
) -> torch.Tensor:
    """From logits [B, T, V]: log-prob of each next token [B, T-1] under the tempered distribution with the
    `suppressed` ids at -inf; 0 at pads and where the target is itself suppressed (a media token of a prompt)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = mask_tokens(logits[:, :-1].float(), suppressed)  # [B, T-1, V]
    if temperature != 1.0:
        scaled = scaled / temperature
    targets = input_ids[:, 1:]  # [B, T-1]
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    out = picked - scaled.logsumexp(-1)  # [B, T-1]; -inf where the target is a media token
    real = (mask[:, :-1] * mask[:, 1:]).bool()
    if suppressed.numel():
        real &= ~torch.isin(targets, suppressed.to(targets.device))
    return torch.where(real, out, torch.zeros_like(out))
