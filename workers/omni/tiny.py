"""The `tiny-omni` model source: a Qwen2.5-Omni thinker (text, image, video, audio) built in code, offline.

The policy is `Qwen2_5OmniThinkerForConditionalGeneration` from a tiny config (text: hidden 128, 2 layers,
4 heads / 2 KV heads, M-RoPE sections [4, 6, 6]; vision tower: depth 2, hidden 64, patch 14, merge 2,
temporal patch 2; audio tower: 2 layers, d_model 64), about 0.7M parameters, deterministic from the seed.
Its processor is built offline too: the byte tokenizer plus the Omni media special tokens (named through
`extra_special_tokens`, which the Omni processor reads) and the task answer words as single tokens,
`Qwen2VLImageProcessorPil` for images, `WhisperFeatureExtractor(feature_size=128)` for audio and
`NumpyVideoProcessor` for video. Model and processor are saved with `save_pretrained` into one directory
that `workers.omni.loading.load_omni` reloads like any real multimodal Hugging Face directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5OmniProcessor,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)
from transformers.utils import logging as hf_logging

from relax_bus.log import get_logger
from workers.data.model_build import holds_build, install_build, staging_dir
from workers.data.tokenizer import BOS, BOS_ID, EOS, EOS_ID, PAD, PAD_ID, SPECIAL_IDS, _byte_alphabet
from workers.omni import video
from workers.omni.tasks import ANSWER_WORDS

log = get_logger(__name__)

SOURCE = "tiny-omni"
MEDIA_TOKENS: dict[str, str] = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
"""The Omni processor's media special tokens, by the attribute names it reads from the tokenizer."""
MEDIA_IDS = {name: 259 + i for i, name in enumerate(MEDIA_TOKENS)}
"""Their ids: right after the byte tokenizer's 259 (bytes, pad, bos, eos)."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte tokenizer + media special tokens + answer words, split so that `<|IMAGE|>` in text is one token.

    Unlike the text-only byte tokenizer, special-token names inside text are not split into bytes: the
    processor writes media placeholders into the prompt text and needs them read back as single tokens.
    """
    vocab = {ch: b for b, ch in enumerate(_byte_alphabet())}
    vocab.update({PAD: PAD_ID, BOS: BOS_ID, EOS: EOS_ID})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, EOS, *MEDIA_TOKENS.values()]
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    core.add_tokens([AddedToken(w, normalized=False) for w in ANSWER_WORDS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        extra_special_tokens=dict(MEDIA_TOKENS),
        model_max_length=1 << 30,
    )
    found = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in MEDIA_TOKENS.items()}
    if found != MEDIA_IDS:
        raise RuntimeError(f"media token ids moved: {found} != {MEDIA_IDS}")
    return tokenizer


def build_processor() -> Qwen2_5OmniProcessor:
    """The offline Omni processor: tokenizer, PIL image processor, Whisper features, numpy video processor."""
    video.install()
    size = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}
    return Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2, size=size),
        video_processor=video.NumpyVideoProcessor(patch_size=14, temporal_patch_size=2, merge_size=2),
        feature_extractor=WhisperFeatureExtractor(feature_size=128),
        tokenizer=build_tokenizer(),
    )


def tiny_omni_config(vocab_size: int) -> Qwen2_5OmniThinkerConfig:
    """The thinker config of `tiny-omni` over a vocabulary of `vocab_size` tokens."""
    text = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        "tie_word_embeddings": True,
        **SPECIAL_IDS,
    }
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "out_hidden_size": 128,
        "fullatt_block_indexes": [1],
    }
    audio = {
        "num_mel_bins": 128,
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "d_model": 64,
        "output_dim": 128,
    }
    return Qwen2_5OmniThinkerConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        image_token_index=MEDIA_IDS["image_token"],
        audio_token_index=MEDIA_IDS["audio_token"],
        video_token_index=MEDIA_IDS["video_token"],
        vision_start_token_id=MEDIA_IDS["vision_bos_token"],
        vision_end_token_id=MEDIA_IDS["vision_eos_token"],
        audio_start_token_id=MEDIA_IDS["audio_bos_token"],
        audio_end_token_id=MEDIA_IDS["audio_eos_token"],
        tie_word_embeddings=True,
        dtype="float32",
        **SPECIAL_IDS,
    )


def build_tiny_omni(target_dir: Path, seed: int = 0) -> Path:
    """Build and save `tiny-omni` (model + processor) into `target_dir`, or reuse a directory holding that build."""
    target_dir = Path(target_dir)
    record = {"source": SOURCE, "seed": seed}
    if holds_build(target_dir, record):
        return target_dir
    staging = staging_dir(target_dir)
    processor = build_processor()
    config = tiny_omni_config(len(processor.tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5OmniThinkerForConditionalGeneration(config)
    hf_logging.disable_progress_bar()
    model.save_pretrained(staging, safe_serialization=True)
    processor.save_pretrained(staging)
    if not (staging / "config.json").is_file():
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"building {SOURCE} saved no config.json (only torch.distributed rank 0 can save)")
    if not install_build(staging, target_dir, record):
        return target_dir
    params = sum(p.numel() for p in model.parameters())
    log.info("model_built", source=SOURCE, seed=seed, params=params, dir=str(target_dir))
    return target_dir
