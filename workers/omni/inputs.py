"""What a media prompt carries to the engines and the trainer: the processor's tensors for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MediaInputs = dict[str, "torch.Tensor"]
"""The processor's tensors for one prompt: input_ids [1, T], attention_mask [1, T] and its media tensors
(pixel_values, image_grid_thw, input_features, feature_attention_mask, pixel_values_videos, video_grid_thw, ...)."""
