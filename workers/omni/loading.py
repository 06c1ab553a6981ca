"""Load a multimodal policy and its processor from one Hugging Face directory (built here or a real one).

A directory is multimodal when it holds a processor config (`processor_config.json` or
`preprocessor_config.json`). The model class is the first of the config's `architectures` (for `tiny-omni`,
`Qwen2_5OmniThinkerForConditionalGeneration`); the processor loads with `AutoProcessor`, after the numpy
video processor is made findable (transformers' own video processors need torchvision).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoProcessor, PreTrainedModel
from transformers.utils import logging as hf_logging

from workers.omni import video
from workers.omni.errors import UnsupportedModelError

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def is_multimodal(model_dir: Path) -> bool:
    """True when `model_dir` holds a processor config next to the model (a multimodal directory)."""
    return any((Path(model_dir) / name).is_file() for name in PROCESSOR_FILES)


def load_omni(model_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, Any]:
    """Load the multimodal model in `model_dir` (eval mode, eager attention) and its processor."""
    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    if not config_file.is_file() or not is_multimodal(model_dir):
        raise UnsupportedModelError(f"{model_dir} is not a multimodal model directory (config.json + processor config)")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        raise UnsupportedModelError(f"{model_dir}: config.json names no model class transformers has: {architectures}")
    video.install()
    hf_logging.disable_progress_bar()
    model = model_class.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager")
    processor = AutoProcessor.from_pretrained(str(model_dir))
    return model.eval(), processor
