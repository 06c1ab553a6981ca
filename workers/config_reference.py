"""docs/configuration.md, generated from the config models.

    python -m workers.config_reference > docs/configuration.md

Every key of a run config with its type, default and the docstring under its field. A test keeps the
page equal to this output, so the reference cannot drift from the code.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel, ByteSize, RootModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from workers.config import PipelineConfig

HEADER = """# Configuration reference

Generated from the config models (`relax_bus/settings.py`, `relax_bus/chain.py`, `workers/config/`)
by `python -m workers.config_reference`; a test fails when this page and the code differ. A run config
is a YAML or JSON file given to `relax init` or `relax run`; `relax config show CONFIG` prints it with
every default filled in. Unknown keys, unknown plug-in types and out-of-range values are refused with
every problem listed.

Swappable parts (`rollout.engine`, `trainer.advantage`, `task`, `rewards[]`, `weights`) are chosen by
their `type`; the options of each type are listed under it. `engine: vllm` is short for
`engine: {type: vllm}` (likewise for the advantage and the weights).
"""


def _plain(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            fields = type(value).model_fields
            if "type" in fields and len(fields) <= 3:
                return f"`{value.model_dump(mode='json', include={'type'})['type']}`"
            return "(see below)"
        return f"`{json.dumps(value)}`"
    if field.default is PydanticUndefined:
        return "required"
    if isinstance(field.default, BaseModel):
        return "(see below)"
    return f"`{json.dumps(field.default)}`"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a type with its validators (`ConfigPath`, `ByteCount`): the type
        return _type_name(typing.get_args(annotation)[0])
    if annotation is ByteSize:
        return "bytes (int or `256MiB`)"
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return annotation.__name__.removesuffix("Config") if issubclass(annotation, BaseModel) else annotation.__name__
    return str(annotation)


def _selected_by_type(model: type[BaseModel]) -> bool:
    """Whether `model` is one of a swappable part's types (a `type` field with a literal value), not a model whose
    `type` names something free-form (`agent.env.type`: a built-in environment or `module:Class`)."""
    field = model.model_fields.get("type")
    return field is not None and typing.get_origin(field.annotation) is typing.Literal


def _members(annotation: Any) -> list[type[BaseModel]]:
    """The models a field holds: itself, a union's members, a list's item, or none."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, tuple):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _section(prefix: str, model: type[BaseModel], out: list[str], depth: int) -> None:
    rows, nested = [], []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        members = _members(annotation)
        union = len(members) > 1 or (members and _selected_by_type(members[0]) and name != "options")
        key = f"{prefix}{name}"
        listed = typing.get_origin(annotation) is tuple
        kind = ("list, each " if listed else "") + "one of the types below" if union else _type_name(annotation)
        meaning = _plain(field.description) or ("Selects this type." if name == "type" else "")
        rows.append(f"| `{key}` | {kind} | {_default(field)} | {meaning} |")
        for member in members:
            nested.append((key, member, bool(union)))
    if rows:
        out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    for key, member, union in nested:
        if key == "chain":
            continue  # filled in from the role registry, never written by hand
        if issubclass(member, RootModel):  # a map (`roles`): one row per key it takes
            out += [f"{'#' * min(depth + 1, 6)} {key}", "", _plain(member.__doc__), ""]
            rows = [f"| `{key}.{k}` | int | `{d}` | {_plain(m)} |" for k, d, m in member.rows()]  # type: ignore[attr-defined]
            out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
            continue
        title = key
        if union and "type" in member.model_fields:
            title = f"{key}: `type: {typing.get_args(member.model_fields['type'].annotation)[0]}`"
        out += [f"{'#' * min(depth + 1, 6)} {title}", "", _plain(member.__doc__), ""]
        _section(f"{key}.", member, out, depth + 1)


def render() -> str:
    """The whole page."""
    out = [HEADER]
    _section("", PipelineConfig, out, 1)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
