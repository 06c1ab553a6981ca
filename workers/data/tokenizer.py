"""A byte-level tokenizer built in code: every byte is one token, plus pad/bos/eos.

Ids 0..255 are the byte values themselves (no merges), `<pad>`=256, `<bos>`=257, `<eos>`=258.
It is a `tokenizers` BPE model with an empty merge list over the GPT-2 byte-to-unicode alphabet,
wrapped as a transformers fast tokenizer so it saves and loads like any Hugging Face tokenizer
(offline). Encoding never adds bos/eos: callers prefix bos themselves. Special-token names inside
text are split into bytes (`split_special_tokens`), so any text, even "<eos>", round-trips exactly.

`tokenizer_mismatch` says whether two models read token ids alike (a teacher and its student must).
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
VOCAB_SIZE = 259


def _byte_alphabet() -> list[str]:
    """The 256 printable characters the byte-level pre-tokenizer maps bytes 0..255 to, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


SPECIAL_IDS = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
"""The byte tokenizer's special ids, as the keyword arguments of a transformers model config."""


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build the byte tokenizer (259 ids) as a transformers fast tokenizer."""
    return byte_level_tokenizer({})


def byte_level_tokenizer(extra: dict[str, int]) -> PreTrainedTokenizerFast:
    """The byte tokenizer with `extra` strings of byte characters as further ids (no merges: no text encodes to
    them, but each decodes), e.g. to give a model of a real vocabulary size an id for every row."""
    vocab = {ch: b for b, ch in enumerate(_byte_alphabet())}
    vocab.update({PAD: PAD_ID, BOS: BOS_ID, EOS: EOS_ID})
    vocab.update(extra)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, BOS, EOS)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        model_max_length=1 << 30,
        split_special_tokens=True,
    )


SHARED_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
"""The special token ids two tokenizers must share for one's token ids to mean the same to the other."""


def tokenizer_mismatch(mine: PreTrainedTokenizerBase, theirs: PreTrainedTokenizerBase) -> str | None:
    """How `theirs` differs from `mine` where the other model would read the same ids differently, or None: the
    vocabulary (every token and its id), the special ids and the chat template."""
    vocab, other = mine.get_vocab(), theirs.get_vocab()
    if vocab != other:
        changed = sorted(set(vocab.items()) ^ set(other.items()), key=lambda kv: kv[1])[:3]
        return f"the vocabularies differ ({len(vocab)} vs {len(other)} tokens; e.g. {changed})"
    for name in SHARED_IDS:
        a, b = getattr(mine, name, None), getattr(theirs, name, None)
        if a != b:
            return f"{name} differs ({a} vs {b})"
    if getattr(mine, "chat_template", None) != getattr(theirs, "chat_template", None):
        return "the chat templates differ"
    return None
