"""Hub repositories as local directories: `snapshot_download` once into the hub cache, then a path every role
(and vLLM) loads from.

The cache is `cache_dir` when the config names one, else the Hugging Face cache (`workers.config.hub`); with
`HF_HUB_OFFLINE=1` nothing is downloaded and the snapshot must already be in the cache (its layout:
`models--org--name/refs/<branch>` holding a commit, `models--org--name/snapshots/<commit>/...` the files;
`datasets--org--name/...` for a dataset).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from workers.config.hub import hub_settings


def snapshot(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    repo_type: Literal["model", "dataset"] = "model",
) -> Path:
    """The local directory of `repo_id` at `revision` (null: `main`) in the hub cache, downloaded there first
    unless the hub is off; ValueError in one line naming the repo and revision when it cannot be had."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    settings = hub_settings()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else settings.cache()
    name = f"{'hf:' if repo_type == 'model' else 'dataset '}{repo_id}@{revision or 'main'}"
    try:
        path = huggingface_hub.snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=revision,
            cache_dir=str(cache),
            local_files_only=settings.hf_hub_offline,
        )
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if settings.hf_hub_offline else " and the hub cannot be reached"
        raise ValueError(f"{name} is not in the Hugging Face cache {cache}{offline}") from None
    except (HfHubHTTPError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{name} cannot be downloaded into {cache}: {first}") from None
    return Path(path)
