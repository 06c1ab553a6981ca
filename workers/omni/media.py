"""A prompt's parts (text, image, audio, video) -> the processor's tensors for one multimodal forward.

Each media part is decoded into what the Hugging Face processor takes: a PIL image from image bytes, a mono
float32 waveform at the feature extractor's sample rate from WAV/FLAC/OGG bytes (soundfile; resampled
linearly when the rate differs), and a clip of frames [T, H, W, 3] uint8 from `FRAMES_MIME` bytes (an
`np.save` array) or from frames given in memory. Container video (mp4, webm) is refused for now: decoding
it needs `av`, which is not wired yet. The prompt text places one placeholder per media item, in order
(`<|vision_bos|><|IMAGE|><|vision_eos|>`, `<|audio_bos|><|AUDIO|><|audio_eos|>`,
`<|vision_bos|><|VIDEO|><|vision_eos|>`); the processor expands each placeholder to as many media tokens
as the item's features take, so the returned `input_ids` are the ids the engine samples after and the
trainer scores. Media beyond `MediaLimits` is refused with a one-line `MediaError`.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile
import torch
from PIL import Image

from schemas.parts import AudioPart, ImagePart, MediaRef, Part, TextPart, VideoPart
from workers.omni.errors import MediaError
from workers.omni.inputs import MediaInputs

FRAMES_MIME = "video/x-npy-frames"
"""A clip as the bytes of `np.save(frames)`, frames uint8 [T, H, W, 3]: video without a container decoder."""

MediaReader = Callable[[MediaRef], bytes]
"""Reads a referenced payload (an object-store digest or a URI) into bytes."""


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on what one prompt may carry: larger media is refused, not silently cut."""

    max_pixels: int = 448 * 448
    """Most pixels (width x height) of one image or one video frame."""
    max_frames: int = 32
    """Most frames of one clip."""
    max_audio_seconds: float = 30.0
    """Longest audio clip (the Whisper features of the Omni audio tower cover 30 s)."""
    max_items: int = 8
    """Most media items in one prompt."""


@dataclass
class PromptMedia:
    """A prompt decoded for the processor: its text with one placeholder per item, and the items in order."""

    text: str
    images: list[Image.Image]
    audios: list[np.ndarray]
    videos: list[np.ndarray]
    fps: float | None = None


def decode_image(data: bytes, limits: MediaLimits = MediaLimits()) -> Image.Image:
    """Image bytes (PNG, JPEG, ...) -> an RGB PIL image, refused beyond `limits.max_pixels`."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError) as err:
        raise MediaError(f"cannot decode image: {err}") from err
    _check_pixels(image.width, image.height, limits, "image")
    return image.convert("RGB")


def decode_audio(data: bytes, sample_rate: int, limits: MediaLimits = MediaLimits()) -> np.ndarray:
    """Audio bytes (WAV, FLAC, OGG) -> mono float32 waveform at `sample_rate`, refused beyond the length limit."""
    try:
        wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as err:
        raise MediaError(f"cannot decode audio: {err}") from err
    seconds = len(wave) / rate
    if seconds > limits.max_audio_seconds:
        raise MediaError(f"audio of {seconds:.1f} s exceeds the limit of {limits.max_audio_seconds} s")
    if len(wave) == 0:
        raise MediaError("audio clip is empty")
    return resample(wave.mean(axis=1), int(rate), sample_rate)


def resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Linear-interpolation resampling of a mono waveform [N] from `rate` to `target` Hz (float32)."""
    if rate == target:
        return wave.astype(np.float32, copy=False)
    count = max(1, round(len(wave) * target / rate))
    times = np.arange(count) * (rate / target)
    return np.interp(times, np.arange(len(wave)), wave).astype(np.float32)


def decode_video(data: bytes, mime: str, limits: MediaLimits = MediaLimits()) -> np.ndarray:
    """Video bytes -> frames uint8 [T, H, W, 3]; only `FRAMES_MIME` for now (container decoding needs `av`)."""
    if mime != FRAMES_MIME:
        raise MediaError(f"video {mime} cannot be decoded yet: send frames as {FRAMES_MIME} (np.save of [T, H, W, 3])")
    try:
        frames = np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError) as err:
        raise MediaError(f"cannot decode video frames: {err}") from err
    return check_frames(frames, limits)


def check_frames(frames: Any, limits: MediaLimits = MediaLimits()) -> np.ndarray:
    """Frames (an array [T, H, W, 3] or a list of arrays / PIL images) -> one uint8 array, within the limits."""
    if not isinstance(frames, np.ndarray):
        frames = np.stack([np.asarray(f.convert("RGB") if isinstance(f, Image.Image) else f) for f in frames])
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise MediaError(f"video frames must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    if not 1 <= len(frames) <= limits.max_frames:
        raise MediaError(f"video of {len(frames)} frames is outside 1..{limits.max_frames}")
    _check_pixels(frames.shape[2], frames.shape[1], limits, "video frame")
    return frames


def decode_parts(
    parts: Sequence[Part],
    tokenizer: Any,
    sample_rate: int = 16000,
    read: MediaReader | None = None,
    limits: MediaLimits = MediaLimits(),
) -> PromptMedia:
    """Decode a prompt's parts and write its text: bos, then each part in order (media as its placeholder)."""
    media = [p for p in parts if not isinstance(p, TextPart)]
    if len(media) > limits.max_items:
        raise MediaError(f"{len(media)} media items in one prompt exceed the limit of {limits.max_items}")
    out = PromptMedia(text=tokenizer.bos_token or "", images=[], audios=[], videos=[])
    for part in parts:
        if isinstance(part, TextPart):
            out.text += part.text
        elif isinstance(part, ImagePart):
            out.images.append(decode_image(_payload(part, read), limits))
            out.text += tokenizer.vision_bos_token + tokenizer.image_token + tokenizer.vision_eos_token
        elif isinstance(part, AudioPart):
            out.audios.append(decode_audio(_payload(part, read), sample_rate, limits))
            out.text += tokenizer.audio_bos_token + tokenizer.audio_token + tokenizer.audio_eos_token
        elif isinstance(part, VideoPart):
            out.videos.append(decode_video(_payload(part, read), part.mime, limits))
            out.text += tokenizer.vision_bos_token + tokenizer.video_token + tokenizer.vision_eos_token
            out.fps = part.fps if part.fps is not None else out.fps
    return out


def processor_inputs(processor: Any, prompt: PromptMedia) -> MediaInputs:
    """Run the processor on one decoded prompt -> its tensors (input_ids expanded with the media tokens).

    Audio is padded to the longest clip of the prompt instead of the processor's 30 s: the features of the
    valid frames are the same and the audio tower runs ~10x less. `video_second_per_grid` comes from `fps`
    (the processor's default of 2 frames per second when the part does not say).
    """
    kwargs: dict[str, Any] = {"return_tensors": "pt"}
    if prompt.audios:
        hop = int(getattr(processor.feature_extractor, "hop_length", 160))
        longest = max(len(a) for a in prompt.audios)
        kwargs["audio_kwargs"] = {"max_length": -(-longest // hop) * hop}
    if prompt.videos and prompt.fps is not None:
        kwargs["videos_kwargs"] = {"fps": prompt.fps}
    features = processor(
        text=[prompt.text],
        images=prompt.images or None,
        audio=prompt.audios or None,
        videos=prompt.videos or None,
        **kwargs,
    )
    out: MediaInputs = {}
    for key, value in features.items():
        out[key] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


def _payload(part: ImagePart | AudioPart | VideoPart, read: MediaReader | None) -> bytes:
    """The part's bytes: inline, or read through `read` from its reference."""
    if part.inline is not None:
        return part.inline
    if read is None or part.ref is None:
        raise MediaError(f"{part.type} part refers to {part.ref} but no media store reader was given")
    return read(part.ref)


def _check_pixels(width: int, height: int, limits: MediaLimits, what: str) -> None:
    """Refuse an image or frame larger than `limits.max_pixels`."""
    if width * height > limits.max_pixels:
        raise MediaError(f"{what} of {width}x{height} pixels exceeds the limit of {limits.max_pixels} pixels")
