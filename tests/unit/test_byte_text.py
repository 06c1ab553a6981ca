"""The reward role decodes the byte tokenizer's ids without a tokenizer library: the same text as the tokenizer,
invalid UTF-8 and special ids included."""

from __future__ import annotations

import random

import pytest

from workers.data.byte_text import ByteDecoder
from workers.data.tokenizer import VOCAB_SIZE, build_byte_tokenizer

pytestmark = pytest.mark.unit


def test_the_byte_decoder_decodes_as_the_byte_tokenizer_does():
    tokenizer, decoder, rng = build_byte_tokenizer(), ByteDecoder(), random.Random(0)
    cases = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(20))] for _ in range(2000)]
    cases += [[0xC3], [0xC3, 0xA9, 258], list("héllo €".encode())]
    for ids in cases:
        assert decoder.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids
