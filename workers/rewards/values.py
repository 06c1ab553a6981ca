"""What a reward function is and what it may return, shared by the scorer and its sandboxed child.

Standard library only: the sandbox child imports this before it runs any user code.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable
from typing import Any

RewardValue = float | dict[str, float]
RewardFn = Callable[..., RewardValue]


def checked(value: Any) -> RewardValue:
    """The value as a finite float or a dict of finite floats; TypeError/ValueError otherwise."""
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    return finite(value)


def checked_batch(value: Any, count: int) -> list[float]:
    """A batched reward's value as `count` finite floats; TypeError/ValueError otherwise."""
    if not isinstance(value, list | tuple):
        raise TypeError(f"batched reward function returned {type(value).__name__}, expected a list of {count} floats")
    if len(value) != count:
        raise ValueError(f"batched reward function returned {len(value)} values for {count} completions")
    return [finite(v) for v in value]


def accepted(fn: RewardFn, candidates: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `candidates` that `fn` declares (all of them when it takes `**kwargs`)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except ValueError:  # some builtins have no signature: give them nothing extra
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(candidates)
    named = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return {k: v for k, v in candidates.items() if k in named}


def finite(value: Any) -> float:
    """A finite float from an int or a float; TypeError for anything else, ValueError for NaN and inf."""
    if not isinstance(value, int | float):
        raise TypeError(f"reward function returned {type(value).__name__}, expected a float or a dict of floats")
    if not math.isfinite(value):
        raise ValueError(f"reward function returned {value}")
    return float(value)


def describe(err: BaseException) -> str:
    """`ExceptionType: message`, the text recorded with a zero reward."""
    return f"{type(err).__name__}: {err}"


def code_dir(ref: str) -> str | None:
    """The directory of the file a `path/to/file.py:name` reference names; None for `module:name`."""
    module_name = ref.rpartition(":")[0]
    return os.path.dirname(os.path.abspath(module_name)) if module_name.endswith(".py") else None


def import_function(ref: str) -> RewardFn:
    """The callable named by `module:qualified.name`, or by `path/to/file.py:qualified.name` (the file imported
    as a module of its own)."""
    module_name, _, qualname = ref.rpartition(":")
    obj: Any
    if module_name.endswith(".py"):
        name = "relax_reward_" + os.path.basename(module_name).removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, module_name)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {module_name}")
        obj = importlib.util.module_from_spec(spec)
        sys.modules[name] = obj
        spec.loader.exec_module(obj)
    else:
        obj = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{ref} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]
