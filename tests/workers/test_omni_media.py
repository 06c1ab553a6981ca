"""Media parts -> processor inputs: decoding, limits, the numpy video processor, and the generated omni tasks."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from schemas.parts import AudioPart, ImagePart, MediaRef, TextPart, VideoPart
from workers.omni.errors import MediaError
from workers.omni.media import (
    FRAMES_MIME,
    MediaLimits,
    check_frames,
    decode_audio,
    decode_image,
    decode_parts,
    decode_video,
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
from workers.omni.tiny import MEDIA_TOKENS, build_tokenizer
from workers.omni.video import NumpyVideoProcessor

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
    assert np.allclose(resample(np.arange(4, dtype=np.float32), 2, 4), [0, 0.5, 1, 1.5, 2, 2.5, 3, 3])
    with pytest.raises(MediaError, match="exceeds the limit"):
        decode_audio(wav(2.0, 16000), 16000, MediaLimits(max_audio_seconds=1.0))
    with pytest.raises(MediaError, match="cannot decode audio"):
        decode_audio(b"RIFF nonsense", 16000)


def test_video_frames_decode_and_are_bounded() -> None:
    frames = np.random.default_rng(0).integers(0, 256, (3, 28, 28, 3), dtype=np.uint8)
    assert np.array_equal(decode_video(npy(frames), FRAMES_MIME), frames)
    assert np.array_equal(check_frames([Image.fromarray(f) for f in frames]), frames)
    with pytest.raises(MediaError, match="cannot be decoded yet"):
        decode_video(b"\x00\x00\x00\x18ftypmp42", "video/mp4")
    with pytest.raises(MediaError, match=r"outside 1\.\.2"):
        decode_video(npy(frames), FRAMES_MIME, MediaLimits(max_frames=2))
    with pytest.raises(MediaError, match="uint8"):
        check_frames(frames.astype(np.float32))
    with pytest.raises(MediaError, match="video frame of 28x28"):
        check_frames(frames, MediaLimits(max_pixels=100))


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
