"""Command-line overrides of a run config: `section.key=value`, deep and typed, validated with the file.

    relax run examples/demo.yaml trainer.optim.lr=1e-4 rollout.engine.type=vllm 'rewards=[{type: exact}]'

The key is a dotted path into the config mapping (a list element by its index: `rewards.0.weight=2`);
the value is read as a YAML scalar or flow collection (`1e-4` is a float, `[a, b]` a list, `null` is
None, `'7'` the string 7). Overrides are applied to the mapping read from the file, before validation,
so an override is checked like the file's own keys: an unknown key, a wrong type or a value out of
range is one line of the same ConfigError. A scalar where the path goes deeper is read as the
`type` shorthand of a plug-in section (`engine: vllm` is `engine: {type: vllm}`), so
`rollout.engine.max_model_len=512` works on a file that says `engine: vllm`.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from relax_bus.errors import ConfigError
from relax_bus.settings import C, RunConfig, parse_run_config

SOURCE = "command-line overrides"
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.([A-Za-z_][A-Za-z0-9_-]*|\d+))*$")
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
"""YAML 1.2 floats that PyYAML (YAML 1.1) reads as strings: `1e-4`, `5E3`."""


def parse_value(text: str) -> Any:
    """The value of `key=value`: a YAML scalar or flow collection; raises ValueError when it is not YAML."""
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as err:
        mark = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"not a YAML value: {mark}") from None
    if isinstance(value, str) and value == text.strip() and _FLOAT.match(value):
        return float(value)
    return value


def parse_overrides(assignments: Sequence[str]) -> dict[str, Any]:
    """`["trainer.optim.lr=1e-4", ...]` -> `{"trainer.optim.lr": 0.0001, ...}`; ConfigError listing every malformed one.

    A key given twice keeps its last value (as later flags win)."""
    out: dict[str, Any] = {}
    problems = []
    for item in assignments:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            problems.append(f"{item!r}: expected section.key=value")
        elif not _KEY.match(key):
            problems.append(f"{item!r}: {key!r} is not a dotted key (letters, digits, _ and - between dots)")
        else:
            try:
                out[key] = parse_value(text)
            except ValueError as err:
                problems.append(f"{key}: {err} (got {text!r})")
    if problems:
        raise ConfigError(SOURCE, problems)
    return out


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `data` with each dotted key of `overrides` set; ConfigError for a path that cannot be set."""
    result: dict[str, Any] = copy.deepcopy(dict(data))
    problems = []
    for key, value in overrides.items():
        try:
            _set(result, key.split("."), value)
        except _PathError as err:
            problems.append(f"{key}: {err}")
    if problems:
        raise ConfigError(SOURCE, problems)
    return result


class _PathError(Exception):
    """Raised when a dotted path runs into a list index that is not there or into a value that has no keys."""


def _set(node: Any, path: list[str], value: Any) -> None:
    head, rest = path[0], path[1:]
    if isinstance(node, list):
        if not head.isdigit() or int(head) >= len(node):
            raise _PathError(f"{head!r} is not an index of the {len(node)} element(s) there")
        index = int(head)
        if rest:
            node[index] = _descend(node[index])
            _set(node[index], rest, value)
        else:
            node[index] = value
        return
    if rest:
        child = node.get(head)
        node[head] = {} if child is None else _descend(child)
        _set(node[head], rest, value)
    else:
        node[head] = value


def _descend(child: Any) -> Any:
    """The node to go into: a mapping or list as is, a string as the `{type: ...}` shorthand it stands for."""
    if isinstance(child, dict | list):
        return child
    if isinstance(child, str):
        return {"type": child}
    raise _PathError(f"the value there is {child!r}, which has no keys")


def read_config_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML or JSON config file; ConfigError when it cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(str(path), [f"cannot read file: {err.strerror or err}"]) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise ConfigError(str(path), [f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), [f"top level must be a mapping, got {type(data).__name__}"])
    return data


def load_with_overrides(
    path: str | Path,
    overrides: Mapping[str, Any] | None = None,
    model: type[C] = RunConfig,  # type: ignore[assignment]
) -> C:
    """Read a config file, set the dotted `overrides` in it, and validate the result as `model`.

    Every problem, the overrides' included, is one line of one ConfigError, named after the file (and
    the overrides, when there are any). The validation context `{"config_dir": ...}` is the file's directory,
    absolute: the fields that are paths read a relative one from there (the pipeline's config types them so)."""
    data = apply_overrides(read_config_mapping(path), overrides or {})
    source = f"{path} with {SOURCE}" if overrides else str(path)
    return parse_run_config(data, source, model, {"config_dir": str(Path(path).resolve().parent)})
