"""A numpy video processor for the Qwen vision towers, so that video works without torchvision.

Every video processor that ships with transformers needs torchvision, which is not installable next to
the CPU torch build. This one does what the Qwen2-VL video processor does, with PIL and numpy: resize each
frame to a multiple of `patch_size * merge_size` (within `min_pixels`..`max_pixels`), rescale to [0, 1],
normalise with the CLIP mean and std, repeat the last frame up to a multiple of `temporal_patch_size`,
and cut the clip into flattened patches in the order the vision tower reads them:

    pixel_values_videos  [grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch]  float32
    video_grid_thw       [videos, 3]  long

The size the Omni processor passes by default (`size`, for 28-pixel patches) is ignored: the bounds come
from this processor's own `min_pixels` / `max_pixels`, saved with it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2_5OmniConfig, Qwen2_5OmniThinkerConfig
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.video_processing_utils import VideoProcessorMixin


class NumpyVideoProcessor(VideoProcessorMixin):
    """Qwen-style video patches from frames given as numpy arrays [T, H, W, 3] uint8 (or lists of frames)."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(
        self,
        patch_size: int = 14,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        min_pixels: int = 56 * 56,
        max_pixels: int = 224 * 224,
        image_mean: list[float] | None = None,
        image_std: list[float] | None = None,
        **kwargs: Any,
    ) -> None:
        size = kwargs.pop("size", None)  # a saved Qwen video processor's bounds, when loading a real one
        if isinstance(size, dict):
            min_pixels = int(size.get("shortest_edge", min_pixels))
            max_pixels = int(size.get("longest_edge", max_pixels))
        for unused in ("video_processor_type", "processor_class"):
            kwargs.pop(unused, None)
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.image_mean = list(image_mean or OPENAI_CLIP_MEAN)
        self.image_std = list(image_std or OPENAI_CLIP_STD)

    def preprocess(self, videos: Any, **kwargs: Any) -> BatchFeature:  # type: ignore[override]
        """Patchify one clip or a list of clips; processor kwargs other than `return_tensors` are ignored."""
        clips = [videos] if _is_one_clip(videos) else list(videos)
        patches, grids = [], []
        for clip in clips:
            flat, grid = self._patchify(_frames_array(clip))
            patches.append(flat)
            grids.append(grid)
        return BatchFeature(
            data={
                "pixel_values_videos": torch.from_numpy(np.concatenate(patches)),
                "video_grid_thw": torch.tensor(grids, dtype=torch.long),
            }
        )

    def _patchify(self, frames: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """One clip [T, H, W, 3] uint8 -> flattened patches [t*h*w, C*tp*p*p] float32 and its grid [t, h, w]."""
        _, height, width, _ = frames.shape
        factor = self.patch_size * self.merge_size
        new_h, new_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        resized = np.stack(
            [np.asarray(Image.fromarray(f).resize((new_w, new_h), Image.Resampling.BICUBIC)) for f in frames]
        )
        pixels = resized.astype(np.float32) / 255.0  # [T, H, W, C]
        pixels = (pixels - np.array(self.image_mean, np.float32)) / np.array(self.image_std, np.float32)
        pixels = pixels.transpose(0, 3, 1, 2)  # [T, C, H, W]
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if len(pixels) % tp:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], tp - len(pixels) % tp, axis=0)])
        grid_t, grid_h, grid_w = len(pixels) // tp, new_h // p, new_w // p
        channels = pixels.shape[1]
        patches = pixels.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
        return np.ascontiguousarray(flat, dtype=np.float32), [grid_t, grid_h, grid_w]


def _is_one_clip(videos: Any) -> bool:
    """True for one clip (an array [T, H, W, C] or a list of frames), False for a list of clips."""
    if isinstance(videos, np.ndarray):
        return videos.ndim == 4
    first = videos[0]
    return isinstance(first, Image.Image) or (isinstance(first, np.ndarray) and first.ndim == 3)


def _frames_array(clip: Any) -> np.ndarray:
    """A clip as one uint8 array [T, H, W, 3]."""
    frames = [np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in clip]
    return np.stack(frames).astype(np.uint8)


def install() -> None:
    """Make the class findable by transformers' processor loading, which looks sub-processors up by name.

    Without torchvision, `transformers.VideoProcessorMixin` is not exported and `AutoVideoProcessor` resolves
    nothing, so neither the Omni processor's type check nor `AutoProcessor.from_pretrained` finds any video
    processor. The names are set on both module objects transformers consults (the package, and the copy
    `processing_utils` imports directly), and the class is registered for the Qwen Omni configs.
    """
    from transformers import processing_utils

    for module in {id(m): m for m in (sys.modules["transformers"], processing_utils.transformers_module)}.values():
        module.VideoProcessorMixin = VideoProcessorMixin
        module.NumpyVideoProcessor = NumpyVideoProcessor
    auto = importlib.import_module("transformers.models.auto.video_processing_auto")
    for config_class in (Qwen2_5OmniThinkerConfig, Qwen2_5OmniConfig):
        auto.AutoVideoProcessor.register(
            config_class, video_processor_classes={"torchvision": NumpyVideoProcessor}, exist_ok=True
        )
