"""`relax model warmup CONFIG --out DIR`: a run config's policy after its supervised warm-up, as a model directory.

The warm-up is the actor's own (`workers.training.warmup`: `trainer.warmup` of the config, on its task's
demonstrations or reference answers), run in this process without a bus. The directory it writes is a Hugging Face
model directory like `relax export` writes, so it serves as another run's `model.source` (a warm start) or
`teacher.source` (a teacher for on-policy distillation, as docs/algorithms.md builds one in code).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.config import PipelineConfig, task_spec
from workers.data.model_build import install_build, staging_dir


def warmed_model(
    config: PipelineConfig, out: Path, on_check: Callable[[dict[str, float]], None] | None = None
) -> dict[str, Any]:
    """Warm `config`'s policy up as its actor would and write it to `out` (created; refused when it holds files).
    Returns the warm-up's figures and the record written beside the weights."""
    import torch

    from workers.data.models import load_tokenizer, materialize
    from workers.data.tasks import load_task
    from workers.training.trainer import PolicyTrainer
    from workers.training.warmup import run_warmup

    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty")
    if config.trainer.warmup.max_steps == 0:
        raise ValueError("trainer.warmup.max_steps is 0: there is no warm-up to run")
    with tempfile.TemporaryDirectory(prefix="relax-warmup-") as scratch:
        base = materialize(config.model.source, Path(scratch) / "base", config.model.seed)
        trainer = PolicyTrainer(base, config)
        info = run_warmup(trainer, load_task(task_spec(config.task)), on_check)
        staging = staging_dir(out)
        with torch.no_grad():
            trainer.model.save_pretrained(staging, safe_serialization=True)
        load_tokenizer(base).save_pretrained(staging)
    record = {
        "source": "warmup",
        "base": config.model.source.shorthand(),
        "seed": config.model.seed,
        "task": config.task.type,
        **{k: float(v) for k, v in info.items()},
    }
    install_build(staging, out, record)
    return record
