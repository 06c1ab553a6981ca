"""Tiny verifiable omni tasks generated in code: one media item, a question, a one-word answer.

- `colour`: a square of one of 4 colours on a grey 56x56 image (PNG). Answer: the colour's name.
- `beeps`: 1 to 4 beeps (880 Hz, 0.12 s) in 1 s of 16 kHz audio (16-bit PCM WAV). Answer: the count as a digit.
- `direction`: a white square moving left, right, up or down across 4 frames of 56x56 video
  (`FRAMES_MIME` bytes). Answer: the direction. Hard for tiny-omni: 400 supervised steps leave it at chance.
- `change`: a square of one colour in the first two of 4 frames of 56x56 video and another colour in the last
  two. Answer: the colour at the end (the first colour is a distractor: only the frames' order tells them apart).
- `mixed`: an image (as `colour`) and 1 s of audio (as `beeps`) in one prompt, and one of the two questions.
  Answer: the asked one's (the other medium is a distractor: the question says which to read).

Each item's media is a prompt part ready for a `PromptGroup` (inline bytes). The answer words are single
tokens of the `tiny-omni` tokenizer (`ANSWER_WORDS`; digits are single bytes already). `read_*` recover the
answer from the decoded media, so tests can check that media and answers agree.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from schemas.parts import AudioPart, ImagePart, Part, TextPart, VideoPart
from workers.data.task_items import TaskItem

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 200, 30),
    "blue": (30, 30, 220),
    "yellow": (230, 220, 30),
}
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
"""Direction name -> (row step, column step) of the moving square."""
ANSWER_WORDS = (*COLOURS, *DIRECTIONS)
"""Answer words the tiny-omni tokenizer holds as single tokens."""

SIDE = 56
BACKGROUND = (128, 128, 128)
SAMPLE_RATE = 16000
BEEP_HZ, BEEP_S, GAP_S = 880.0, 0.12, 0.08
FRAMES = 4
Kind = Literal["colour", "beeps", "direction", "change", "mixed"]
KINDS: tuple[Kind, ...] = ("colour", "beeps", "direction", "change", "mixed")
QUESTIONS: dict[str, str] = {
    "colour": "Colour?",
    "beeps": "How many beeps?",
    "direction": "Which way?",
    "change": "Colour at the end?",
}
"""Short questions: the byte tokenizer spends one token per character, and every row of a group repeats them."""


@dataclass(frozen=True)
class OmniItem:
    """One task item: the media (as a prompt part's mime and bytes), the question and the answer word."""

    kind: Kind
    mime: str
    data: bytes
    question: str
    answer: str
    audio: bytes = b""
    """A `mixed` item's audio clip (WAV), after its image (`mime`, `data`)."""


def make_items(kind: Kind, count: int, seed: int = 0) -> list[OmniItem]:
    """`count` items of one kind, deterministic from `seed`, answers drawn uniformly."""
    if kind not in KINDS:
        raise ValueError(f"unknown omni task {kind!r}; known: {', '.join(KINDS)}")
    rng = np.random.default_rng(seed)
    return [_MAKERS[kind](rng) for _ in range(count)]


def colour_image(colour: str, rng: np.random.Generator) -> bytes:
    """PNG bytes of a grey SIDE x SIDE image with a square of `colour` at a random place and size."""
    from PIL import Image, ImageDraw

    size = int(rng.integers(14, 29))
    top, left = (int(v) for v in rng.integers(0, SIDE - size + 1, size=2))
    image = Image.new("RGB", (SIDE, SIDE), BACKGROUND)
    ImageDraw.Draw(image).rectangle([left, top, left + size - 1, top + size - 1], fill=COLOURS[colour])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def beeps_wave(count: int, rng: np.random.Generator) -> np.ndarray:
    """1 s of float32 audio at SAMPLE_RATE with `count` beeps (quiet noise elsewhere), starting at a random offset."""
    wave = (rng.standard_normal(SAMPLE_RATE) * 0.005).astype(np.float32)
    span = count * BEEP_S + (count - 1) * GAP_S
    start = float(rng.uniform(0.02, 1.0 - span - 0.02))
    t = np.arange(int(BEEP_S * SAMPLE_RATE)) / SAMPLE_RATE
    tone = (0.5 * np.sin(2 * np.pi * BEEP_HZ * t)).astype(np.float32)
    for i in range(count):
        at = int((start + i * (BEEP_S + GAP_S)) * SAMPLE_RATE)
        wave[at : at + len(tone)] += tone
    return wave


def moving_frames(direction: str, rng: np.random.Generator) -> np.ndarray:
    """FRAMES frames uint8 [T, SIDE, SIDE, 3]: a white 12-pixel square stepping 8 pixels per frame in `direction`."""
    size, step = 12, 8
    dr, dc = DIRECTIONS[direction]
    travel = step * (FRAMES - 1)
    low_r, high_r = (travel, SIDE - size) if dr < 0 else (0, SIDE - size - travel * abs(dr))
    low_c, high_c = (travel, SIDE - size) if dc < 0 else (0, SIDE - size - travel * abs(dc))
    row, col = int(rng.integers(low_r, high_r + 1)), int(rng.integers(low_c, high_c + 1))
    frames = np.full((FRAMES, SIDE, SIDE, 3), BACKGROUND, dtype=np.uint8)
    for f in range(FRAMES):
        r, c = row + dr * step * f, col + dc * step * f
        frames[f, r : r + size, c : c + size] = 255
    return frames


def changing_frames(first: str, last: str, rng: np.random.Generator) -> np.ndarray:
    """FRAMES frames uint8 [T, SIDE, SIDE, 3]: a square of colour `first` in the first half, `last` in the second."""
    size = int(rng.integers(14, 29))
    top, left = (int(v) for v in rng.integers(0, SIDE - size + 1, size=2))
    frames = np.full((FRAMES, SIDE, SIDE, 3), BACKGROUND, dtype=np.uint8)
    frames[: FRAMES // 2, top : top + size, left : left + size] = COLOURS[first]
    frames[FRAMES // 2 :, top : top + size, left : left + size] = COLOURS[last]
    return frames


def read_colour(image: object) -> str:
    """The name of the colour closest to the image's non-background pixels (a PIL image)."""
    pixels = np.asarray(image).reshape(-1, 3).astype(np.int32)
    fg = pixels[np.abs(pixels - np.array(BACKGROUND)).sum(-1) > 30].mean(0)
    return min(COLOURS, key=lambda name: float(np.abs(fg - np.array(COLOURS[name])).sum()))


def read_beeps(wave: np.ndarray) -> int:
    """Count the beeps of a waveform: runs of 10 ms windows whose RMS is well above the noise."""
    window = SAMPLE_RATE // 100
    rms = np.sqrt((wave[: len(wave) // window * window].reshape(-1, window) ** 2).mean(-1))
    loud = (rms > 0.1).astype(np.int8)
    return int((np.diff(np.concatenate([[0], loud])) == 1).sum())


def read_direction(frames: np.ndarray) -> str:
    """The direction of the bright square's centroid from the first to the last frame."""
    centres = []
    for frame in frames:
        rows, cols = np.nonzero(frame.min(-1) > 200)
        centres.append((rows.mean(), cols.mean()))
    d_row, d_col = np.subtract(centres[-1], centres[0])
    if abs(d_row) > abs(d_col):
        return "down" if d_row > 0 else "up"
    return "right" if d_col > 0 else "left"


def read_change(frames: np.ndarray) -> str:
    """The colour of the square in the last frame of a `change` clip."""
    from PIL import Image

    return read_colour(Image.fromarray(frames[-1]))


def _colour_item(rng: np.random.Generator) -> OmniItem:
    colour = str(rng.choice(list(COLOURS)))
    return OmniItem("colour", "image/png", colour_image(colour, rng), QUESTIONS["colour"], colour)


def _beeps_item(rng: np.random.Generator) -> OmniItem:
    count = int(rng.integers(1, 5))
    return OmniItem("beeps", "audio/wav", _wav(beeps_wave(count, rng)), QUESTIONS["beeps"], str(count))


def _wav(wave: np.ndarray) -> bytes:
    import soundfile

    buf = io.BytesIO()
    # 16-bit PCM: a float WAV from libsndfile carries a PEAK chunk with the time of writing, so the same
    # seed would give different bytes a second later.
    soundfile.write(buf, wave, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _mixed_item(rng: np.random.Generator) -> OmniItem:
    colour, count = str(rng.choice(list(COLOURS))), int(rng.integers(1, 5))
    image, audio = colour_image(colour, rng), _wav(beeps_wave(count, rng))
    asked = "colour" if rng.integers(2) == 0 else "beeps"
    answer = colour if asked == "colour" else str(count)
    return OmniItem("mixed", "image/png", image, QUESTIONS[asked], answer, audio=audio)


def _direction_item(rng: np.random.Generator) -> OmniItem:
    from workers.omni.media import FRAMES_MIME

    direction = str(rng.choice(list(DIRECTIONS)))
    buf = io.BytesIO()
    np.save(buf, moving_frames(direction, rng), allow_pickle=False)
    return OmniItem("direction", FRAMES_MIME, buf.getvalue(), QUESTIONS["direction"], direction)


def _change_item(rng: np.random.Generator) -> OmniItem:
    from workers.omni.media import FRAMES_MIME

    first, last = (str(c) for c in rng.choice(list(COLOURS), size=2, replace=False))
    buf = io.BytesIO()
    np.save(buf, changing_frames(first, last, rng), allow_pickle=False)
    return OmniItem("change", FRAMES_MIME, buf.getvalue(), QUESTIONS["change"], last)


_MAKERS = {
    "colour": _colour_item,
    "beeps": _beeps_item,
    "direction": _direction_item,
    "change": _change_item,
    "mixed": _mixed_item,
}


def item_parts(item: OmniItem) -> tuple[Part, ...]:
    """The prompt parts of an item: its media inline (a `mixed` item: the image, then the audio), then the question."""
    media: Part
    if item.kind in ("colour", "mixed"):
        media = ImagePart(mime=item.mime, inline=item.data, width=SIDE, height=SIDE)
    elif item.kind == "beeps":
        media = AudioPart(mime=item.mime, inline=item.data, sample_rate=SAMPLE_RATE, duration_s=1.0)
    else:
        media = VideoPart(mime=item.mime, inline=item.data, width=SIDE, height=SIDE)
    if item.kind == "mixed":
        audio = AudioPart(mime="audio/wav", inline=item.audio, sample_rate=SAMPLE_RATE, duration_s=1.0)
        return (media, audio, TextPart(text=item.question))
    return (media, TextPart(text=item.question))


def omni_task(kinds: Sequence[str] = ("colour", "beeps", "change"), count: int = 64, seed: int = 0) -> list[TaskItem]:
    """The `omni` task (`workers.data.tasks.TASKS`): `count` generated items of each kind (an image, audio or video
    part and a question), interleaved kind by kind; the task name of each item is its kind."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"omni: unknown kinds {unknown or list(kinds)}; known: {', '.join(KINDS)}")
    if count < 1:
        raise ValueError(f"omni: count must be at least 1, got {count}")
    made = [make_items(kind, count, seed + k) for k, kind in enumerate(kinds)]  # type: ignore[arg-type]
    rows = [made[k][i] for i in range(count) for k in range(len(kinds))]
    return [TaskItem(item_parts(it), it.answer, it.kind, i) for i, it in enumerate(rows)]
