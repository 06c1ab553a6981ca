"""Model sources: turn a config's `source` string into a Hugging Face model directory, and load it.

Known sources:
- `"tiny"` or `"tiny:<hidden>x<layers>"`: a LlamaForCausalLM built in code (4 heads, MLP 4x hidden,
  tied embeddings, fp32, 256 positions) with the byte tokenizer, deterministic from `seed`, saved
  as safetensors. Built once: a target directory that already holds the same build is reused.
- `"tiny-moe"`: a tiny Qwen3-MoE (8 experts, top-2) over the byte tokenizer, built in code (`workers.moe.tiny`),
  for routing replay (R3, docs/r3.md).
- `"tiny-omni"`: a tiny Qwen2.5-Omni thinker (text, image, video, audio) with its processor, built in code
  (`workers.omni.tiny`); load it with `workers.omni.loading.load_omni`.
- an existing local directory holding `config.json`: used as is.
- `"hf:<repo id>"`: nothing is downloaded here; the directory records the repo id and
  `load_model` / `load_tokenizer` call `from_pretrained(repo id)` later.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import huggingface_hub
import huggingface_hub.constants
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from relax_bus.log import get_logger
from workers.data.tokenizer import SPECIAL_IDS, build_byte_tokenizer

log = get_logger(__name__)

SOURCE_FILE = "relax_source.json"
KNOWN_SOURCES = (
    "'tiny', 'tiny:<hidden>x<layers>' (e.g. 'tiny:128x2'), 'tiny-moe', 'tiny-omni', 'hf:<repo id>', "
    "or a local model directory"
)
TINY_HEADS = 4
TINY_POSITIONS = 256
_TINY = re.compile(r"tiny(?::(\d+)x(\d+))?")


def materialize(source: str, target_dir: Path, seed: int = 0) -> Path:
    """Return a directory holding the model and tokenizer named by `source` (building it if needed)."""
    tiny = _TINY.fullmatch(source)
    if tiny:
        hidden, layers = (int(tiny[1]), int(tiny[2])) if tiny[1] else (128, 2)
        return _build_tiny(hidden, layers, Path(target_dir), seed)
    if source == "tiny-moe":
        from workers.moe.tiny import build_tiny_moe

        return build_tiny_moe(Path(target_dir), seed)
    if source == "tiny-omni":
        from workers.omni.tiny import build_tiny_omni  # imported on demand: the media stack is not needed for text

        return build_tiny_omni(Path(target_dir), seed)
    if source.startswith("hf:"):
        return _point_at_hub(source.removeprefix("hf:"), Path(target_dir))
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    raise ValueError(f"unknown model source {source!r}: expected {KNOWN_SOURCES}")


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
    name = _resolve(Path(model_dir))
    hf_logging.disable_progress_bar()  # tqdm bars would interleave with the structured log lines
    model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype, attn_implementation="eager")
    return model.eval()  # type: ignore[no-any-return]


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved next to the model in `model_dir`."""
    return _from_pretrained(AutoTokenizer, _resolve(Path(model_dir)))  # type: ignore[no-any-return]


def _build_tiny(hidden: int, layers: int, target_dir: Path, seed: int) -> Path:
    """Build, save and return a tiny Llama directory, or reuse one that holds the same build."""
    config = tiny_config(hidden, layers)
    return build_in_code(
        {"source": f"tiny:{hidden}x{layers}", "seed": seed}, lambda: LlamaForCausalLM(config), target_dir
    )


def build_in_code(record: dict[str, Any], make: Callable[[], PreTrainedModel], target_dir: Path) -> Path:
    """Build a model with `make()` (seeded by `record["seed"]`), save it with the byte tokenizer into `target_dir`
    and return that directory; a directory that already holds the same build is reused."""
    if holds_build(target_dir, record):
        return target_dir
    staging = staging_dir(target_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(record["seed"]))
        model = make()
    hf_logging.disable_progress_bar()
    model.save_pretrained(staging, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(staging)
    # transformers writes no config or weights on a torch.distributed rank other than 0: such a directory
    # must never become the model of the run (every role would find it without config.json).
    missing = [name for name in ("config.json", "model.safetensors") if not (staging / name).is_file()]
    if missing:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(
            f"building {record['source']} saved no {', '.join(missing)} (a torch.distributed rank other than 0 "
            "cannot save a model): build it on rank 0 and let the other ranks wait for it"
        )
    if install_build(staging, target_dir, record):
        params = sum(p.numel() for p in model.parameters())
        log.info("model_built", source=record["source"], seed=record["seed"], params=params, dir=str(target_dir))
    return target_dir


def staging_dir(target_dir: Path) -> Path:
    """An empty directory beside `target_dir` to save a build into (unique per build: processes in containers
    sharing a volume all run as pid 1)."""
    staging = target_dir.parent / f".{target_dir.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def install_build(staging: Path, target_dir: Path, record: dict[str, Any]) -> bool:
    """Mark `staging` with the build `record` and move it to `target_dir`, whole or not at all. False when
    another process installed the same build first (this one is then discarded)."""
    (staging / SOURCE_FILE).write_text(json.dumps(record))
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        if target_dir.is_dir() and not any(target_dir.iterdir()):
            target_dir.rmdir()
        staging.rename(target_dir)
    except OSError:
        # Tolerated: another process built the same directory first; it is checked just below.
        shutil.rmtree(staging, ignore_errors=True)
        if not holds_build(target_dir, record):
            raise
        return False
    return True


def holds_build(target_dir: Path, record: dict[str, Any]) -> bool:
    """True when `target_dir` already holds the build `record` describes; ValueError for another model."""
    if not (target_dir / "config.json").is_file():
        return False
    marker = target_dir / SOURCE_FILE
    found = json.loads(marker.read_text()) if marker.is_file() else None
    if found != record:
        raise ValueError(f"{target_dir} already holds another model ({found or 'unknown source'}), not {record}")
    return True


def _point_at_hub(repo: str, target_dir: Path) -> Path:
    """Record a hub repo id in `target_dir`; refuse at once when the hub is off and the repo is not cached."""
    if not repo:
        raise ValueError("hf: source needs a repo id, e.g. 'hf:HuggingFaceTB/SmolLM2-135M'")
    cached = huggingface_hub.try_to_load_from_cache(repo, "config.json")
    if huggingface_hub.constants.HF_HUB_OFFLINE and not isinstance(cached, str):
        raise ValueError(f"model source hf:{repo} needs the Hugging Face hub, but HF_HUB_OFFLINE is set")
    target_dir.mkdir(parents=True, exist_ok=True)
    (target_dir / SOURCE_FILE).write_text(json.dumps({"source": f"hf:{repo}"}))
    return target_dir


def _resolve(model_dir: Path) -> str:
    """The name to hand to `from_pretrained`: the directory itself, or the hub repo id it records."""
    marker = model_dir / SOURCE_FILE
    if marker.is_file() and not (model_dir / "config.json").is_file():
        source = json.loads(marker.read_text())["source"]
        if isinstance(source, str) and source.startswith("hf:"):
            return source.removeprefix("hf:")
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model directory {model_dir} has no config.json; build it with materialize()")
    return str(model_dir)


def _from_pretrained(loader: Any, name: str, **kwargs: Any) -> Any:
    """Call `loader.from_pretrained(name)`, turning an unreachable hub repo into a one-line ValueError."""
    try:
        return loader.from_pretrained(name, **kwargs)
    except OSError as err:
        if Path(name).is_dir():
            raise
        raise ValueError(f"cannot load hf:{name} (hub unreachable or repo unknown): {err}") from err
