"""Paths in a run config: a relative one is read from the config file's directory, not the working directory.

`relax_bus.overrides.load_with_overrides` validates a config file with the context `{"config_dir": <the file's
directory, absolute>}`; the fields typed `ConfigPath` here turn a relative path into an absolute one under it at
validation (normalised: `..` is folded), so the config `relax init` stores in the run's KV (and every role
validates again from there) holds absolute paths, and every role on every machine reads the same files. Absolute
paths and `~/...` are kept as they are; a mapping validated without a file (`parse_config`) keeps its relative
paths (read from the working directory).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, ValidationInfo

CONFIG_DIR = "config_dir"
"""The validation context key holding the config file's directory."""


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv", ".arrow")
"""Files a dataset path may name: a path ending so is never taken for a hub id."""


def looks_like_hub_id(path: str) -> bool:
    """Whether `path` has the shape of a hub repo id, `org/name` (and does not name a data file)."""
    return _HUB_ID.fullmatch(path) is not None and not path.lower().endswith(DATA_SUFFIXES)


def config_dir(info: ValidationInfo) -> Path | None:
    """The directory of the config file being validated, or None (a mapping without a file)."""
    context = info.context if isinstance(info.context, dict) else {}
    found = context.get(CONFIG_DIR)
    return Path(found) if found is not None else None


def resolve(path: str, info: ValidationInfo) -> str:
    """`path` under the config file's directory when it is relative; absolute and `~` paths as they are."""
    base = config_dir(info)
    if base is None or path.startswith("~") or Path(path).is_absolute():
        return path
    return os.path.normpath(base / path)  # `../models/m` as `/repo/models/m`


def resolve_if_present(path: str, info: ValidationInfo) -> str:
    """`path` as `resolve` makes it, but a hub id (`org/name`) with nothing of that name there as it is."""
    base = config_dir(info)
    if base is not None and looks_like_hub_id(path) and not (base / path).exists():
        return path
    return resolve(path, info)


ConfigPath = Annotated[str, AfterValidator(resolve)]
"""A file or directory; relative: to the config file's directory."""
PathOrHubId = Annotated[str, AfterValidator(resolve_if_present)]
"""A local file or directory (relative: to the config file's directory) or a hub repo id (`org/name`, where
nothing of that name is there)."""
