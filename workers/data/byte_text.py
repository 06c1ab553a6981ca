"""The byte tokenizer's decoding without loading a tokenizer library: what the reward role needs for the models
built in code (`workers.data.tokenizer` builds the tokenizer itself; its ids 0..255 are the byte values, 256 and
up its special tokens). A reward worker of such a run stays free of transformers and tokenizers."""

from __future__ import annotations

from collections.abc import Sequence

BYTE_SOURCES = ("tiny", "tiny-moe")
"""The `model.source` types built in code over the byte tokenizer (their tokenizer needs no model directory)."""


class ByteDecoder:
    """`decode(ids, skip_special_tokens=True)` as the byte tokenizer does it: the bytes, UTF-8 decoded with
    replacement characters where they are not valid UTF-8."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            raise ValueError("the byte decoder skips special tokens only")
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
