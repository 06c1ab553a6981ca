"""A prompt's parts (text, image, audio, video) -> the processor's tensors for one multimodal forward.

Each media part is decoded into what the Hugging Face processor takes: a PIL image from image bytes, a mono
float32 waveform at the feature extractor's sample rate from WAV/FLAC/OGG bytes (soundfile; resampled with
soxr's anti-aliasing filter when the rate differs), and a clip of frames [T, H, W, 3] uint8 from `FRAMES_MIME`
bytes (an `np.save` array, frames already sampled), from frames given in memory, or decoded from mp4 / webm
bytes with PyAV and sampled at the part's `fps` (2 per second when it gives none: the rate the processor then
assumes). soxr and PyAV come with the `omni` extra. The prompt text places one placeholder per media item, in order
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
"""A clip as the bytes of `np.save(frames)`, frames uint8 [T, H, W, 3], already sampled at the part's `fps`."""
CONTAINER_MIMES = ("video/mp4", "video/webm")
"""Container video, decoded with PyAV (`decode_container`) and sampled at the part's `fps`."""
DEFAULT_FPS = 2.0
"""Frames per second sampled from a container video whose part gives no `fps`: the Qwen processors' default."""

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
    """A mono waveform [N] at `rate` Hz -> [round(N * target / rate)] float32 at `target` Hz (soxr, `HQ`).

    soxr low-passes below the lower of the two Nyquist frequencies (min(rate, target) / 2) before it
    resamples, so a tone above the new Nyquist is removed instead of folding back into the band as an alias."""
    if rate == target:
        return wave.astype(np.float32, copy=False)
    import soxr  # the `omni` extra

    return np.asarray(soxr.resample(wave.astype(np.float32, copy=False), rate, target, quality="HQ"), np.float32)


def decode_video(data: bytes, mime: str, limits: MediaLimits = MediaLimits(), fps: float | None = None) -> np.ndarray:
    """Video bytes -> frames uint8 [T, H, W, 3]: `FRAMES_MIME` as sent, a container (`CONTAINER_MIMES`) sampled
    at `fps` frames per second (`DEFAULT_FPS` when None) by `decode_container`."""
    if mime in CONTAINER_MIMES:
        return decode_container(data, DEFAULT_FPS if fps is None else fps, limits)
    if mime != FRAMES_MIME:
        known = ", ".join([*CONTAINER_MIMES, FRAMES_MIME])
        raise MediaError(f"video {mime} is not supported (send one of {known})")
    try:
        frames = np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError) as err:
        raise MediaError(f"cannot decode video frames: {err}") from err
    return check_frames(frames, limits)


def decode_container(data: bytes, fps: float, limits: MediaLimits = MediaLimits()) -> np.ndarray:
    """mp4 / webm bytes -> frames uint8 [T, H, W, 3] sampled at `fps` (PyAV, the `omni` extra).

    Frame k of the clip is the first decoded frame shown at or after k / fps seconds (a frame is taken once: a
    source slower than `fps` gives each of its frames once), so T = floor(duration * fps) + 1 for a source at
    least as fast. These are the frames a `FRAMES_MIME` clip sent at `fps` would carry, and the processor is
    given the same `fps`. A clip longer than `limits.max_frames` at that rate is refused, not cut, and decoding
    stops as soon as it is known."""
    import av  # the `omni` extra

    step = 1.0 / fps
    frames: list[np.ndarray] = []
    next_t = 0.0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("video container has no video stream")
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                t = frame.time if frame.time is not None else len(frames) * step
                if t + 1e-6 < next_t:
                    continue
                _check_pixels(frame.width, frame.height, limits, "video frame")
                if len(frames) == limits.max_frames:
                    raise MediaError(f"video of more than {limits.max_frames} frames at {fps:g} fps exceeds the limit")
                frames.append(frame.to_ndarray(format="rgb24"))
                while next_t <= t + 1e-6:
                    next_t += step
    except av.FFmpegError as err:
        raise MediaError(f"cannot decode video: {err}") from err
    if not frames:
        raise MediaError("video has no frames")
    return check_frames(np.stack(frames), limits)


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
            continue
        decoded = decode_media(part, sample_rate, read, limits)
        if isinstance(part, ImagePart):
            out.images.append(decoded)
            out.text += tokenizer.vision_bos_token + tokenizer.image_token + tokenizer.vision_eos_token
        elif isinstance(part, AudioPart):
            out.audios.append(decoded)
            out.text += tokenizer.audio_bos_token + tokenizer.audio_token + tokenizer.audio_eos_token
        else:
            out.videos.append(decoded)
            out.text += tokenizer.vision_bos_token + tokenizer.video_token + tokenizer.vision_eos_token
            out.fps = part.fps if part.fps is not None else out.fps
    return out


def decode_media(
    part: ImagePart | AudioPart | VideoPart,
    sample_rate: int = 16000,
    read: MediaReader | None = None,
    limits: MediaLimits = MediaLimits(),
) -> Any:
    """One media part decoded: a PIL image, a waveform [N] float32 at `sample_rate`, or frames [T, H, W, 3] uint8
    (video sampled at the part's `fps`); MediaError (one line) when it cannot be or exceeds `limits`."""
    data = _payload(part, read)
    if isinstance(part, ImagePart):
        return decode_image(data, limits)
    if isinstance(part, AudioPart):
        return decode_audio(data, sample_rate, limits)
    return decode_video(data, part.mime, limits, part.fps)


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
