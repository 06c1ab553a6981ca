"""Typed prompt parts: text, image, audio, video.

A media part carries either small inline bytes or a reference: an object-store digest
(`sha256:<hex>` in the run's media store) or a URI the worker can open. Large inline payloads
never hit the NATS size limit: the bus moves any oversized message into the object store
transparently (claim check), so `inline` is safe for anything a producer already holds in memory.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_DIGEST = r"^sha256:[0-9a-f]{64}$"


class MediaRef(BaseModel):
    """Where a media payload lives when it is not inline."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str | None = Field(default=None, pattern=_DIGEST)
    """Content digest of an object in the run's media store."""
    uri: str | None = None
    """Any URI a worker can open (file://, s3://, https://)."""
    size: int | None = Field(default=None, ge=0)
    """Payload size in bytes, when known."""

    @model_validator(mode="after")
    def _one_location(self) -> MediaRef:
        if (self.digest is None) == (self.uri is None):
            raise ValueError("a media reference needs exactly one of digest or uri")
        return self


class _Media(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mime: str = Field(pattern=r"^[\w.+-]+/[\w.+-]+$")
    """MIME type, e.g. image/png, audio/wav, video/mp4."""
    inline: bytes | None = None
    """The payload itself, for small media."""
    ref: MediaRef | None = None
    """The payload's location, for media held elsewhere."""

    @model_validator(mode="after")
    def _inline_or_ref(self) -> _Media:
        if (self.inline is None) == (self.ref is None):
            raise ValueError("a media part needs exactly one of inline or ref")
        return self


class TextPart(BaseModel):
    """Plain text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["text"] = "text"
    text: str


class ImagePart(_Media):
    """A still image."""

    type: Literal["image"] = "image"
    width: int | None = Field(default=None, gt=0)
    height: int | None = Field(default=None, gt=0)


class AudioPart(_Media):
    """A sound clip."""

    type: Literal["audio"] = "audio"
    duration_s: float | None = Field(default=None, ge=0)
    sample_rate: int | None = Field(default=None, gt=0)


class VideoPart(_Media):
    """A video clip."""

    type: Literal["video"] = "video"
    duration_s: float | None = Field(default=None, ge=0)
    width: int | None = Field(default=None, gt=0)
    height: int | None = Field(default=None, gt=0)
    fps: float | None = Field(default=None, gt=0)


Part = Annotated[TextPart | ImagePart | AudioPart | VideoPart, Field(discriminator="type")]
MediaPart = ImagePart | AudioPart | VideoPart
