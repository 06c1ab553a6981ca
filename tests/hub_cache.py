"""A Hugging Face hub cache laid out by hand, as `snapshot_download` leaves it, for offline tests of hub ids."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(
    cache: Path,
    repo_id: str,
    files: Path,
    *,
    commit: str = COMMIT,
    branch: str | None = "main",
    repo_type: Literal["model", "dataset"] = "model",
) -> Path:
    """Put the files of directory `files` into `cache` as `repo_id` at `commit` (`<type>s--org--name/snapshots/
    <commit>/...`), with `refs/<branch>` naming the commit; returns the snapshot directory."""
    root = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snap = root / "snapshots" / commit
    shutil.copytree(files, snap)
    if branch is not None:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / branch).write_text(commit)
    return snap
