"""A multimodal model's processor as the rollout role and the trainer use it: a prompt's parts -> the tensors
of one forward (`workers.omni.media`), with the time it took counted. Payloads that live in the media store
are read beforehand (`workers.omni.media_refs.PayloadCache`); the rollout's expanded prompt ids are what the
trainer checks its own processor output against, so both sides score the same sequence.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schemas.parts import MediaRef, Part
from workers.omni.errors import MediaError
from workers.omni.inputs import MediaInputs
from workers.omni.media import MediaLimits, decode_parts, processor_inputs
from workers.omni.media_refs import read_uri


class MediaPrompter:
    """A multimodal model's processor, turning a prompt's parts into the tensors of one forward."""

    def __init__(self, processor: Any, limits: MediaLimits | None = None, media_root: Path | None = None) -> None:
        self.processor = processor
        self.media_root = media_root
        """The one directory `file://` media are read from (`workers.omni.media_refs.read_uri`); None: none is."""
        self.tokenizer = processor.tokenizer
        self.limits = limits or MediaLimits()
        self.sample_rate = int(getattr(processor.feature_extractor, "sampling_rate", 16000))
        self.seconds = 0.0
        """Processor seconds spent since the start."""

    def inputs(self, parts: Sequence[Part], payloads: dict[MediaRef, bytes] | None = None) -> MediaInputs:
        """Decode `parts` (referenced payloads from `payloads`) and run the processor; MediaError on bad media."""
        started = time.perf_counter()
        held = payloads or {}

        def read(ref: MediaRef) -> bytes:
            if ref in held:
                return held[ref]
            if ref.uri is not None:
                return read_uri(ref.uri, self.media_root)
            raise MediaError(f"media {ref.digest} was not read before decoding")

        try:
            decoded = decode_parts(parts, self.tokenizer, self.sample_rate, read, self.limits)
            return processor_inputs(self.processor, decoded)
        except MediaError:
            raise
        except (ValueError, TypeError, RuntimeError, OSError) as err:  # the processor refusing this media
            raise MediaError(f"the processor cannot take this prompt: {type(err).__name__}: {err}") from None
        finally:
            self.seconds += time.perf_counter() - started
