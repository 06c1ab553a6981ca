"""What every section of the pipeline's run config shares."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A frozen config section that refuses unknown keys; field docstrings are its documentation."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


def shorthand(value: Any) -> Any:
    """`engine: vllm` means `engine: {type: vllm}`."""
    return {"type": value} if isinstance(value, str) else value
