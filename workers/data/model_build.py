"""Models built in code (the tiny ones), saved once into a directory with the byte tokenizer.

A build is described by a record (`{"source", "seed", ...}`) written beside the model (`SOURCE_FILE`); a
directory that already holds the same build is reused, one that holds another model is refused. A build is
saved into a staging directory and renamed into place, so concurrent builders of the same model agree.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from relax_bus.log import get_logger
from workers.data.tokenizer import build_byte_tokenizer

log = get_logger(__name__)

SOURCE_FILE = "relax_source.json"
"""The record of where a model directory came from (a build's record, or the hub repo it names)."""
TINY_POSITIONS = 256
"""Positions of every tiny model built in code."""


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
