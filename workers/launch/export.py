"""`relax export RUN --out DIR [--step N]`: a checkpoint of a run as a Hugging Face model directory.

The directory holds the policy's weights at that step (safetensors), the base model's config,
generation config, tokenizer and chat template: `from_pretrained(DIR)` in transformers and
`LLM(DIR)` in vLLM load it as they load the base model. Without `--step` the newest checkpoint is
taken (the actor always checkpoints the run's last step). Without `--nats-url` the run's own store
(`runs/<run>/nats`, what `relax run` leaves) is opened with an embedded nats-server for the export.

A LoRA run (`trainer.lora`) exports its adapter in peft's format (`adapter_config.json`,
`adapter_model.safetensors`, the tokenizer): `PeftModel.from_pretrained(base, DIR)` loads it on the base model. With
`--merge` it writes the merged model instead, W + (alpha / r) B A in every adapted layer, a plain model directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from relax_bus.bus import Bus
from relax_bus.settings import ConnectionSettings
from workers.checkpoints.sharded import read_model
from workers.checkpoints.whole import read_checkpoint
from workers.config import PipelineConfig
from workers.config.trainer_sections import LoraConfig
from workers.data.model_build import SOURCE_FILE
from workers.data.models import load_model, load_tokenizer, materialize
from workers.errors import CheckpointRefused, ExportFailed
from workers.launch.embedded import serve_run_dir
from workers.roles.actor_checkpoint import kept_checkpoints
from workers.weights.adapter import inject, is_adapter, merged, published, save_adapter


@contextlib.asynccontextmanager
async def run_bus(run: str, settings: ConnectionSettings | None, run_dir: Path) -> AsyncIterator[Bus]:
    """The run's bus: through `settings` when given, else an embedded server on `run_dir/nats`."""
    server = None
    if settings is None:
        store = run_dir / "nats"
        if not store.is_dir():
            raise ExportFailed(f"no NATS store at {store}: pass --nats-url, or --run-dir of a `relax run`")
        server, settings = serve_run_dir(run_dir)
    try:
        async with await Bus.connect(settings, run, name="relax-export", config_model=PipelineConfig) as bus:
            yield bus
    finally:
        if server is not None:
            server.stop()


async def export(bus: Bus, out: Path, step: int | None, work_dir: Path, merge: bool = False) -> dict[str, Any]:
    """Write checkpoint `step` (newest when None) of the run on `bus` to `out`; return what was written. A LoRA
    run's checkpoint is written as its adapter (peft format), or with `merge` as the merged model."""
    cfg = bus.config
    where = await kept_checkpoints(bus)
    kept = sorted(where)
    if not kept:
        raise ExportFailed(f"run {bus.run} has no checkpoint yet")
    chosen = kept[-1] if step is None else step
    if chosen not in kept:
        raise ExportFailed(f"run {bus.run} keeps no checkpoint of step {chosen} (kept: {', '.join(map(str, kept))})")
    if out.exists() and any(out.iterdir()):
        raise ExportFailed(f"{out} is not empty: choose a new --out")
    found = where[chosen]
    source: bytes | Path = Path(found["dir"]) if "dir" in found else await bus.checkpoints.get(found["object"])
    base = await asyncio.to_thread(materialize, cfg.model.source, work_dir / bus.run / "base", cfg.model.seed)
    lora = cfg.trainer.lora
    await asyncio.to_thread(_write, source, base, out, lora, merge)
    record: dict[str, Any] = {"source": "export", "run": bus.run, "step": chosen, "base": cfg.model.source.shorthand()}
    if lora is not None:
        record["lora"] = "merged" if merge else "adapter"
    (out / SOURCE_FILE).write_text(json.dumps(record))
    return {**record, "out": str(out), "files": sorted(p.name for p in out.iterdir())}


def _write(source: bytes | Path, base: Path, out: Path, lora: LoraConfig | None = None, merge: bool = False) -> None:
    """Write the model of checkpoint `source` (an object's bytes, or a directory of shards) on `base`'s files; a LoRA
    run's as its adapter, or (`merge`) merged into the base."""
    model = load_model(base)
    if lora is not None:
        inject(model, lora)
    try:
        if isinstance(source, Path):
            state = read_model(source, like=model.state_dict())
        else:
            state = read_checkpoint(source)["model"]
    except CheckpointRefused as err:
        raise ExportFailed(str(err)) from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A LoRA checkpoint holds the adapter only: the frozen base comes from the base model's files.
    missing = [m for m in missing if is_adapter(m)] if lora is not None else missing
    if unexpected or [m for m in missing if not _tied(model, m)]:
        raise ExportFailed(
            f"checkpoint does not fit the base model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    staging = out.parent / f".{out.name}.exporting"
    shutil.rmtree(staging, ignore_errors=True)
    if lora is None:
        model.save_pretrained(staging, safe_serialization=True)
    elif merge:
        plain = load_model(base)
        plain.load_state_dict(merged(published(model.state_dict()), lora))
        plain.save_pretrained(staging, safe_serialization=True)
    else:
        save_adapter(published(model.state_dict()), lora, base, staging)
    load_tokenizer(base).save_pretrained(staging)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()
    staging.rename(out)


def _tied(model: Any, name: str) -> bool:
    """A weight absent from the checkpoint only because it is tied to another (lm_head to the embeddings)."""
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name == "lm_head.weight"
