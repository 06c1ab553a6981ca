"""`relax export RUN --out DIR [--step N]`: a checkpoint of a run as a Hugging Face model directory.

The directory holds the policy's weights at that step (safetensors), the base model's config,
generation config, tokenizer and chat template: `from_pretrained(DIR)` in transformers and
`LLM(DIR)` in vLLM load it as they load the base model. Without `--step` the newest checkpoint is
taken (the actor always checkpoints the run's last step). Without `--nats-url` the run's own store
(`runs/<run>/nats`, what `relax run` leaves) is opened with an embedded nats-server for the export.
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
from workers.data.models import SOURCE_FILE, load_model, load_tokenizer, materialize
from workers.errors import CheckpointRefused, ExportFailed
from workers.launch.embedded import serve_run_dir
from workers.roles.actor_checkpoint import kept_checkpoints


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


async def export(bus: Bus, out: Path, step: int | None, work_dir: Path) -> dict[str, Any]:
    """Write checkpoint `step` (newest when None) of the run on `bus` to `out`; return what was written."""
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
    await asyncio.to_thread(_write, source, base, out)
    record = {"source": "export", "run": bus.run, "step": chosen, "base": cfg.model.source.shorthand()}
    (out / SOURCE_FILE).write_text(json.dumps(record))
    return {**record, "out": str(out), "files": sorted(p.name for p in out.iterdir())}


def _write(source: bytes | Path, base: Path, out: Path) -> None:
    """Write the model of checkpoint `source` (an object's bytes, or a directory of shards) on `base`'s files."""
    model = load_model(base)
    try:
        if isinstance(source, Path):
            state = read_model(source, like=model.state_dict())
        else:
            state = read_checkpoint(source)["model"]
    except CheckpointRefused as err:
        raise ExportFailed(str(err)) from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not _tied(model, m)]:
        raise ExportFailed(
            f"checkpoint does not fit the base model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    staging = out.parent / f".{out.name}.exporting"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    load_tokenizer(base).save_pretrained(staging)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()
    staging.rename(out)


def _tied(model: Any, name: str) -> bool:
    """A weight absent from the checkpoint only because it is tied to another (lm_head to the embeddings)."""
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name == "lm_head.weight"
