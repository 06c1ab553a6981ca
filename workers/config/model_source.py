"""Where the policy comes from (`model.source`): one model per kind of source, keyed by `type`.

The strings of earlier configs stay accepted as shorthand and are parsed into the union before validation:

    tiny                 {type: tiny}                       (hidden 128, layers 2)
    tiny:<h>x<l>         {type: tiny, hidden: <h>, layers: <l>}
    tiny-moe             {type: tiny-moe}
    tiny-omni            {type: tiny-omni}
    hf:<repo id>[@<rev>] {type: hf, id: <repo id>, revision: <rev>}
    <org>/<name>         {type: hf, id: <org>/<name>}  (a bare hub id: no directory of that name is there)
    anything else        {type: dir, path: <it>}

A relative directory is read from the config file's directory (`workers.config.paths`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo

from workers.config.base import Section
from workers.config.paths import ConfigPath, config_dir, looks_like_hub_id

TINY_HEADS = 4
"""Attention heads of a tiny Llama: its hidden size is a multiple of twice this."""
_TINY = re.compile(r"tiny(?::(\d+)x(\d+))?")


class TinySource(Section):
    """A small Llama built in code over the byte tokenizer (4 heads, MLP 4x hidden, tied embeddings, fp32)."""

    type: Literal["tiny"] = "tiny"
    hidden: int = Field(default=128, ge=2 * TINY_HEADS, multiple_of=2 * TINY_HEADS)
    """Hidden size; a multiple of 8."""
    layers: int = Field(default=2, ge=1)
    """Decoder layers."""

    def shorthand(self) -> str:
        """The source as a string: `tiny:<hidden>x<layers>`."""
        return f"tiny:{self.hidden}x{self.layers}"


class TinyMoeSource(Section):
    """A small Qwen3-MoE built in code (8 experts, top-2; docs/r3.md)."""

    type: Literal["tiny-moe"]

    def shorthand(self) -> str:
        """The source as a string."""
        return self.type


class TinyOmniSource(Section):
    """A small Qwen2.5-Omni thinker built in code with its processor: text, image, audio and video (docs/omni.md)."""

    type: Literal["tiny-omni"]

    def shorthand(self) -> str:
        """The source as a string."""
        return self.type


class DirSource(Section):
    """A local Hugging Face model directory (with its `config.json`), used as is."""

    type: Literal["dir"]
    path: ConfigPath = Field(min_length=1)
    """The directory; `~` is expanded, a relative one is read from the config file's directory."""

    def shorthand(self) -> str:
        """The source as a string: the path."""
        return self.path


class HfSource(Section):
    """A Hugging Face hub repository, materialised once with `huggingface_hub.snapshot_download` into the hub cache;
    every role (and vLLM) then loads the same local snapshot directory."""

    type: Literal["hf"]
    id: str = Field(min_length=1)
    """The repo id, e.g. `HuggingFaceTB/SmolLM2-135M`."""
    revision: str | None = Field(default=None, min_length=1)
    """A branch, tag or commit of the repo; null: its default branch (`main`)."""
    cache_dir: ConfigPath | None = Field(default=None, min_length=1)
    """The hub cache it is downloaded into and loaded from (`models--org--name/snapshots/<commit>`), shared by the
    run's machines; null: the Hugging Face cache (`HF_HUB_CACHE`, else `<HF_HOME>/hub`). With `HF_HUB_OFFLINE=1`
    nothing is downloaded: a repo that is not in the cache is refused before the run starts."""

    def shorthand(self) -> str:
        """The source as a string: `hf:<id>` (`@<revision>` when one is pinned)."""
        return f"hf:{self.id}" + (f"@{self.revision}" if self.revision else "")


def parse_source(value: Any, info: ValidationInfo) -> Any:
    """A source string (`tiny:128x2`, `tiny-moe`, `hf:<repo>`, `org/name`, a directory) as the mapping of its union
    member; mappings and models pass through. `org/name` is a hub id unless a directory of that name is there
    (relative to the config file's directory, or to the working directory without a file)."""
    if not isinstance(value, str):
        return value
    if tiny := _TINY.fullmatch(value):
        return {"type": "tiny"} if tiny[1] is None else {"type": "tiny", "hidden": int(tiny[1]), "layers": int(tiny[2])}
    if value.startswith("tiny:"):
        raise ValueError(f"tiny source {value!r}: expected tiny:<hidden>x<layers>, e.g. tiny:128x2")
    if value in ("tiny-moe", "tiny-omni"):
        return {"type": value}
    if value.startswith("hf:"):
        repo, _, revision = value.removeprefix("hf:").partition("@")
        return {"type": "hf", "id": repo, **({"revision": revision} if revision else {})}
    if looks_like_hub_id(value) and not ((config_dir(info) or Path(".")) / value).is_dir():
        return {"type": "hf", "id": value}
    return {"type": "dir", "path": value}


AnySource = TinySource | TinyMoeSource | TinyOmniSource | DirSource | HfSource
ModelSource = Annotated[AnySource, Field(discriminator="type"), BeforeValidator(parse_source)]
"""`model.source`: a union member, or its shorthand string."""
