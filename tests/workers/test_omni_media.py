"""Media parts -> processor inputs: decoding, limits, the numpy video processor, and the generated omni tasks."""

from __future__ import annotations

import io
import json

import av
import numpy as np
import pytest
import soundfile
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from relax_bus.errors import ConfigError
from schemas.parts import AudioPart, ImagePart, MediaRef, TextPart, VideoPart
from workers.config import parse_config
from workers.omni.errors import MediaError
from workers.omni.media import (
    FRAMES_MIME,
    MediaLimits,
    check_frames,
    decode_audio,
    decode_image,
    decode_parts,
    decode_video,
    processor_inputs,
    resample,
)
from workers.omni.tasks import (
    ANSWER_WORDS,
    COLOURS,
    DIRECTIONS,
    KINDS,
    QUESTIONS,
    item_parts,
    make_items,
    read_beeps,
    read_change,
    read_colour,
    read_direction,
)
from workers.omni.tiny import MEDIA_TOKENS, build_processor, build_tokenizer
from workers.omni.video import NumpyVideoProcessor
from workers.preflight import preflight

pytestmark = pytest.mark.workers


def png(width: int, height: int, colour: tuple[int, int, int] = (10, 20, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float, rate: int, channels: int = 1) -> bytes:
    wave = np.sin(np.arange(int(seconds * rate)) / 7).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, np.stack([wave] * channels, axis=1), rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def npy(frames: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, frames, allow_pickle=False)
    return buf.getvalue()


def test_images_decode_and_are_bounded() -> None:
    image = decode_image(png(40, 30))
    assert (image.size, image.mode, image.getpixel((0, 0))) == ((40, 30), "RGB", (10, 20, 30))
    with pytest.raises(MediaError, match="exceeds the limit"):
        decode_image(png(40, 30), MediaLimits(max_pixels=1000))
    with pytest.raises(MediaError, match="cannot decode image"):
        decode_image(b"not an image")


def test_audio_decodes_to_mono_at_the_target_rate_and_is_bounded() -> None:
    wave = decode_audio(wav(0.5, 16000, channels=2), 16000)
    assert (wave.dtype, wave.shape) == (np.float32, (8000,))
    assert np.allclose(wave, np.sin(np.arange(8000) / 7), atol=1e-6)
    assert decode_audio(wav(0.5, 8000), 16000).shape == (8000,)  # resampled 8 kHz -> 16 kHz
    with pytest.raises(MediaError, match="exceeds the limit"):
        decode_audio(wav(2.0, 16000), 16000, MediaLimits(max_audio_seconds=1.0))
    with pytest.raises(MediaError, match="cannot decode audio"):
        decode_audio(b"RIFF nonsense", 16000)


def tone(hz: float, rate: int, seconds: float = 1.0) -> np.ndarray:
    return np.sin(2 * np.pi * hz * np.arange(int(rate * seconds)) / rate).astype(np.float32)


def test_resampling_keeps_in_band_tones_and_removes_aliases() -> None:
    # 48 kHz -> 16 kHz: the new Nyquist is 8 kHz. Edges left out: the filter's start-up and tail.
    core = slice(800, -800)
    kept = resample(tone(1000, 48000), 48000, 16000)
    assert (kept.dtype, kept.shape) == (np.float32, (16000,))
    assert np.abs(kept[core] - tone(1000, 16000)[core]).max() < 0.01
    # 11 kHz is above the new Nyquist: decimating it (or interpolating linearly) folds it to 16 - 11 = 5 kHz
    # at full amplitude (rms 0.71); the anti-aliasing filter removes it (below -40 dB).
    folded = resample(tone(11000, 48000), 48000, 16000)
    assert np.sqrt(np.mean(folded[core] ** 2)) < 0.01
    assert np.sqrt(np.mean(tone(11000, 48000)[::3][core] ** 2)) > 0.5  # what plain decimation leaves
    up = resample(tone(440, 8000), 8000, 16000)  # upsampling keeps the tone too
    assert np.abs(up[core] - tone(440, 16000)[core]).max() < 0.01


def test_video_frames_decode_and_are_bounded() -> None:
    frames = np.random.default_rng(0).integers(0, 256, (3, 28, 28, 3), dtype=np.uint8)
    assert np.array_equal(decode_video(npy(frames), FRAMES_MIME), frames)
    assert np.array_equal(check_frames([Image.fromarray(f) for f in frames]), frames)
    with pytest.raises(MediaError, match="video/avi is not supported"):
        decode_video(npy(frames), "video/avi")
    with pytest.raises(MediaError, match=r"outside 1\.\.2"):
        decode_video(npy(frames), FRAMES_MIME, MediaLimits(max_frames=2))
    with pytest.raises(MediaError, match="uint8"):
        check_frames(frames.astype(np.float32))
    with pytest.raises(MediaError, match="video frame of 28x28"):
        check_frames(frames, MediaLimits(max_pixels=100))


def encoded(fmt: str, codec: str, levels: list[int], rate: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """A clip written with PyAV: one frame per level (every pixel that grey level), `rate` frames per second."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        for level in levels:
            frame = np.full((size[1], size[0], 3), level, np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


LEVELS = [20, 50, 80, 110, 140, 170, 200, 230]
"""Eight frames, 0.25 s apart at 4 fps: frame k shown from k / 4 s."""


@pytest.mark.parametrize(("fmt", "mime", "codec"), [("mp4", "video/mp4", "libx264"), ("webm", "video/webm", "libvpx")])
def test_container_video_decodes_and_is_sampled_at_the_parts_fps(fmt: str, mime: str, codec: str) -> None:
    clip = encoded(fmt, codec, LEVELS, rate=4)

    def levels(frames: np.ndarray) -> list[int]:
        assert frames.dtype == np.uint8 and frames.shape[1:] == (48, 64, 3)
        return [round(float(f.mean()) / 10) * 10 for f in frames]  # lossy codecs: a level within a few units

    assert levels(decode_video(clip, mime, fps=4.0)) == LEVELS
    assert levels(decode_video(clip, mime, fps=2.0)) == LEVELS[::2]  # frames at 0, 0.5, 1.0, 1.5 s
    assert levels(decode_video(clip, mime)) == LEVELS[::2]  # no fps: 2 per second, the processor's default
    assert levels(decode_video(clip, mime, fps=8.0)) == LEVELS  # a slower source: each frame once
    with pytest.raises(MediaError, match="more than 3 frames at 2 fps"):
        decode_video(clip, mime, MediaLimits(max_frames=3), fps=2.0)
    with pytest.raises(MediaError, match="video frame of 64x48"):
        decode_video(clip, mime, MediaLimits(max_pixels=1000))
    with pytest.raises(MediaError, match="cannot decode video"):
        decode_video(clip[: len(clip) // 3], mime)  # cut short: the index or the frames are missing
    with pytest.raises(MediaError, match="cannot decode video"):
        decode_video(b"\x00\x00\x00\x18ftypmp42 not a movie", mime)


def test_an_mp4_part_reaches_the_processor_as_a_clip() -> None:
    processor = build_processor()
    clip = encoded("mp4", "libx264", LEVELS, rate=4, size=(56, 56))
    prompt = decode_parts([VideoPart(mime="video/mp4", inline=clip, fps=2.0), TextPart(text="?")], processor.tokenizer)
    assert [v.shape for v in prompt.videos] == [(4, 56, 56, 3)] and prompt.fps == 2.0
    inputs = processor_inputs(processor, prompt)
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]]  # 4 frames / temporal patch 2, 56 px / 14
    video_token = processor.tokenizer.convert_tokens_to_ids(MEDIA_TOKENS["video_token"])
    assert int((inputs["input_ids"] == video_token).sum()) == 2 * 4 * 4 // 4  # merged 2x2


def test_parts_become_text_with_one_placeholder_per_item_in_order() -> None:
    tok = build_tokenizer()
    frames = np.zeros((2, 28, 28, 3), np.uint8)
    parts = [
        TextPart(text="look "),
        ImagePart(mime="image/png", inline=png(28, 28)),
        AudioPart(mime="audio/wav", inline=wav(0.25, 16000)),
        VideoPart(mime=FRAMES_MIME, inline=npy(frames), fps=4.0),
        TextPart(text="?"),
    ]
    prompt = decode_parts(parts, tok)
    t = MEDIA_TOKENS
    assert prompt.text == (
        f"{tok.bos_token}look {t['vision_bos_token']}{t['image_token']}{t['vision_eos_token']}"
        f"{t['audio_bos_token']}{t['audio_token']}{t['audio_eos_token']}"
        f"{t['vision_bos_token']}{t['video_token']}{t['vision_eos_token']}?"
    )
    assert (len(prompt.images), len(prompt.audios), len(prompt.videos), prompt.fps) == (1, 1, 1, 4.0)
    ids = tok.encode(prompt.text)
    assert ids.count(tok.convert_tokens_to_ids(t["image_token"])) == 1  # a placeholder is one token, not bytes
    ref = ImagePart(mime="image/png", ref=MediaRef(digest="sha256:" + "0" * 64))
    with pytest.raises(MediaError, match="no media store reader"):
        decode_parts([ref], tok)
    assert len(decode_parts([ref], tok, read=lambda _: png(8, 8)).images) == 1
    with pytest.raises(MediaError, match="exceed the limit of 1"):
        decode_parts([ref, ref], tok, read=lambda _: png(8, 8), limits=MediaLimits(max_items=1))


def test_answer_words_are_single_tokens() -> None:
    tok = build_tokenizer()
    for word in ANSWER_WORDS:
        assert len(tok.encode(word)) == 1, word
    assert tok.decode(tok.encode("red<eos>")) == "red<eos>"


def test_video_patches_match_the_image_processor_on_a_still_clip() -> None:
    """A clip of one frame repeated twice cuts into the same patches as that frame as an image."""
    frame = np.random.default_rng(1).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    image_out = Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2)(
        images=[Image.fromarray(frame)], return_tensors="pt"
    )
    video_out = NumpyVideoProcessor(min_pixels=56 * 56, max_pixels=224 * 224)(np.stack([frame, frame]))
    assert video_out["video_grid_thw"].tolist() == image_out["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert torch.allclose(video_out["pixel_values_videos"], image_out["pixel_values"], atol=1e-5)
    three = NumpyVideoProcessor()([np.stack([frame] * 3), np.stack([frame] * 4)])
    assert three["video_grid_thw"].tolist() == [[2, 4, 6], [2, 4, 6]]  # 3 frames pad to 4 (temporal patch 2)


@pytest.mark.parametrize("kind", KINDS)
def test_generated_tasks_decode_and_their_answers_agree(kind: str) -> None:
    items = make_items(kind, 24, seed=7)  # type: ignore[arg-type]
    assert items == make_items(kind, 24, seed=7)  # type: ignore[arg-type]
    answers = {
        "colour": set(COLOURS),
        "beeps": {"1", "2", "3", "4"},
        "direction": set(DIRECTIONS),
        "change": set(COLOURS),
        "mixed": {*COLOURS, "1", "2", "3", "4"},
    }[kind]
    assert {item.answer for item in items} == answers  # every answer appears in 24 draws
    for item in items:
        *media, question = item_parts(item)
        assert isinstance(question, TextPart) and question.text == item.question
        if kind == "mixed":  # an image and a clip; the question says which one the answer reads
            image, audio = media
            assert isinstance(image, ImagePart) and isinstance(audio, AudioPart) and audio.inline == item.audio
            colour = read_colour(decode_image(item.data))
            beeps = str(read_beeps(decode_audio(item.audio, 16000)))
            read = colour if question.text == QUESTIONS["colour"] else beeps
        elif isinstance(media[0], ImagePart):
            read = read_colour(decode_image(item.data))
        elif isinstance(media[0], AudioPart):
            read = str(read_beeps(decode_audio(item.data, 16000)))
        else:
            assert isinstance(media[0], VideoPart)
            frames = decode_video(item.data, item.mime)
            read = read_direction(frames) if kind == "direction" else read_change(frames)
            if kind == "change":  # the first colour differs from the answer: only the frames' order tells them apart
                assert read_change(frames[:1]) != item.answer
        assert read == item.answer
    with pytest.raises(ValueError, match="unknown omni task"):
        make_items("smell", 1)  # type: ignore[arg-type]


def test_the_pre_start_check_decodes_the_first_items_media(tmp_path) -> None:
    """A broken clip is refused before the run, in one line naming its item, instead of dead-lettered in it."""
    (tmp_path / "good.mp4").write_bytes(encoded("mp4", "libx264", LEVELS, rate=4))
    (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a movie")
    rows = [
        {"prompt": [{"type": "video", "path": name, "fps": 2}, {"type": "text", "text": "?"}], "answer": "a"}
        for name in ("good.mp4", "good.mp4", "bad.mp4")
    ]
    data = tmp_path / "task.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = parse_config({"run": "pf", "task": {"type": "jsonl", "options": {"path": str(data)}}})
    with pytest.raises(ConfigError) as err:
        preflight(config, tmp_path, ("task", "media"))
    [problem] = err.value.problems
    assert problem.startswith("task: item 2, video video/mp4: cannot decode video: ") and "\n" not in problem
    data.write_text("".join(json.dumps(row) + "\n" for row in rows[:2]))
    preflight(config, tmp_path, ("task", "media"))  # the good clips pass
