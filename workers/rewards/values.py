"""What a reward function is and what it may return, shared by the scorer and its sandboxed child.

Standard library only: the sandbox child imports this before it runs any user code.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

RewardValue = float | dict[str, float]
RewardFn = Callable[..., RewardValue]


def checked(value: Any) -> RewardValue:
    """The value as a finite float or a dict of finite floats; TypeError/ValueError otherwise."""
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    return finite(value)


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


def import_function(ref: str) -> RewardFn:
    """The callable named by `module:qualified.name`."""
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{ref} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]
