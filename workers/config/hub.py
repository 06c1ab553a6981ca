"""The Hugging Face hub environment, as settings: where its cache is and whether it may be reached.

The one place the `HF_*` variables are read (`huggingface_hub` reads them too, for what it does by itself);
model sources (`workers.data.models`) and hub datasets (`workers.data.tasks`) are materialised with
`snapshot_download(..., cache_dir=hub_settings().cache(), local_files_only=hub_settings().offline)`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class HubSettings(BaseSettings):
    """The Hugging Face hub's cache and reachability, from the environment (`HF_HOME`, `HF_HUB_CACHE`,
    `HF_HUB_OFFLINE`)."""

    model_config = SettingsConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    hf_home: Path = Field(default=Path("~/.cache/huggingface"))
    """`HF_HOME`: the root of the Hugging Face caches."""
    hf_hub_cache: Path | None = None
    """`HF_HUB_CACHE`: the hub cache (`models--org--name/...`); null: `<HF_HOME>/hub`."""
    hf_hub_offline: bool = False
    """`HF_HUB_OFFLINE`: never reach the hub; a repo that is not in the cache is refused."""

    def cache(self) -> Path:
        """The hub cache directory, absolute."""
        return (self.hf_hub_cache or self.hf_home / "hub").expanduser().resolve()


@lru_cache(maxsize=1)
def hub_settings() -> HubSettings:
    """The process's hub settings, read once."""
    return HubSettings()
