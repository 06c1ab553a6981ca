"""Model sources: turn a config's `model.source` (`workers.config.model_source`) into a Hugging Face model
directory, and load it.

Known sources (each with its shorthand string):
- `tiny` (`"tiny"` or `"tiny:<hidden>x<layers>"`): a LlamaForCausalLM built in code (4 heads, MLP 4x hidden,
  tied embeddings, fp32, 256 positions) with the byte tokenizer, deterministic from `seed`, saved
  as safetensors. Built once: a target directory that already holds the same build is reused.
- `tiny-moe`: a tiny Qwen3-MoE (8 experts, top-2) over the byte tokenizer, built in code (`workers.moe.tiny`),
  for routing replay (R3, docs/r3.md).
- `tiny-omni`: a tiny Qwen2.5-Omni thinker (text, image, video, audio) with its processor, built in code
  (`workers.omni.tiny`); load it with `workers.omni.loading.load_omni`.
- `dir`: an existing local directory holding `config.json`, used as is.
- `hf` (`"hf:<repo id>[@<revision>]"`, or a bare `"org/name"`): `snapshot_download` into the hub cache
  (`workers.data.hub_snapshot`), once; the snapshot directory is what every role and vLLM load, so they all read
  the same files (with `HF_HUB_OFFLINE=1` it must be in the cache already).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel, TypeAdapter
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from workers.config.model_source import (
    TINY_HEADS,
    AnySource,
    DirSource,
    HfSource,
    ModelSource,
    TinyMoeSource,
    TinyOmniSource,
    TinySource,
)
from workers.data.byte_text import BYTE_SOURCES
from workers.data.hub_snapshot import snapshot
from workers.data.model_build import TINY_POSITIONS, build_in_code
from workers.data.tokenizer import SPECIAL_IDS, build_byte_tokenizer

KNOWN_SOURCES = (
    "'tiny', 'tiny:<hidden>x<layers>' (e.g. 'tiny:128x2'), 'tiny-moe', 'tiny-omni', 'hf:<repo id>', 'org/name' "
    "(a hub id), or a local model directory"
)
FAMILIES: dict[str, str] = {
    "tiny-moe": "workers.moe.tiny:build_tiny_moe",
    "tiny-omni": "workers.omni.tiny:build_tiny_omni",
}
"""Sources built in code by their family's package, as `module:function(target_dir, seed) -> directory`; the
module is imported only when a run asks for that source (the media stack is not needed for text)."""


_SOURCE: TypeAdapter[AnySource] = TypeAdapter(ModelSource)


def as_source(source: AnySource | str) -> AnySource:
    """`source` as a union member of `model.source`; a string is its shorthand (`tiny:128x2`, `hf:<repo>`)."""
    return source if isinstance(source, BaseModel) else _SOURCE.validate_python(source)


def materialize(source: AnySource | str, target_dir: Path, seed: int = 0) -> Path:
    """Return a directory holding the model and tokenizer named by `source` (building or downloading it if needed;
    a hub repo's directory is its snapshot in the hub cache, not under `target_dir`)."""
    source = as_source(source)
    if isinstance(source, TinySource):
        return _build_tiny(source.hidden, source.layers, Path(target_dir), seed)
    if isinstance(source, TinyMoeSource | TinyOmniSource):
        module, _, name = FAMILIES[source.type].partition(":")
        build: Callable[[Path, int], Path] = getattr(importlib.import_module(module), name)
        return build(Path(target_dir), seed)
    if isinstance(source, HfSource):
        return snapshot(source.id, source.revision, source.cache_dir)
    assert isinstance(source, DirSource)
    path = Path(source.path).expanduser()
    if not path.is_dir():
        raise ValueError(f"unknown model source {source.path!r}: expected {KNOWN_SOURCES}")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    return path


def tiny_config(hidden: int = 128, layers: int = 2) -> LlamaConfig:
    """The Llama config of a `tiny:<hidden>x<layers>` model over the byte tokenizer."""
    if hidden < 8 or hidden % (2 * TINY_HEADS) or layers < 1:
        raise ValueError(
            f"tiny model needs hidden a multiple of {2 * TINY_HEADS} and layers >= 1, got {hidden}x{layers}"
        )
    return LlamaConfig(
        vocab_size=len(build_byte_tokenizer()),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_HEADS,
        max_position_embeddings=TINY_POSITIONS,
        tie_word_embeddings=True,
        dtype="float32",
        **SPECIAL_IDS,
    )


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load the causal LM in `model_dir` in eval mode with eager attention."""
    name = _model_dir(Path(model_dir))
    hf_logging.disable_progress_bar()  # tqdm bars would interleave with the structured log lines
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="eager")
    return model.eval()  # type: ignore[no-any-return]


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved next to the model in `model_dir`."""
    return AutoTokenizer.from_pretrained(_model_dir(Path(model_dir)))  # type: ignore[no-any-return]


def _build_tiny(hidden: int, layers: int, target_dir: Path, seed: int) -> Path:
    """Build, save and return a tiny Llama directory, or reuse one that holds the same build."""
    config = tiny_config(hidden, layers)
    return build_in_code(
        {"source": f"tiny:{hidden}x{layers}", "seed": seed}, lambda: LlamaForCausalLM(config), target_dir
    )


def _model_dir(model_dir: Path) -> str:
    """`model_dir` as `from_pretrained` takes it; ValueError when it holds no model."""
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model directory {model_dir} has no config.json; build it with materialize()")
    return str(model_dir)


def source_tokenizer(source: AnySource | str, cache_dir: Path | None = None, seed: int = 0) -> PreTrainedTokenizerBase:
    """The tokenizer of `source` without loading its weights: the byte tokenizer of the models built in code over
    it, the one saved with a local or hub model, or, for `tiny-omni`, the one built with it under `cache_dir`."""
    source = as_source(source)
    if source.type in BYTE_SOURCES:
        return build_byte_tokenizer()
    if isinstance(source, HfSource | DirSource):  # nothing is written: a snapshot in the hub cache, or a directory
        return load_tokenizer(materialize(source, Path(".")))
    if cache_dir is None:
        raise ValueError(f"the tokenizer of a {source.type} model is built with it: a cache directory is needed")
    return load_tokenizer(materialize(source, Path(cache_dir) / "base", seed))
