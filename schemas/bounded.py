"""Bounds on what the run's events and metrics may carry: every reader can take any message that decodes.

The events stream is read by the metrics role, `relax run` and dashboards, and any role may publish to it.
A value that decodes must therefore be safe to use as it is: no infinity to turn into an int, no count that
a reader loops over a trillion times, no name that a Prometheus label keeps forever at a megabyte, no
string that fills a terminal. A message outside these bounds fails validation (`InvalidMessage` when
decoded), and a reader passes it over with one log line (`relax_bus.follow`).

Free-form values are finite or NaN: NaN is how a producer says "not computed" (the mean reward of a step
without rewards, the accuracy of a warm-up that did not run) and every reader handles it; an infinity (an
overflowed loss or gradient norm) is kept as NaN, so that a diverging trainer still records its step. The
counters (`COUNTER_KEYS`, `lag_<k>`: step, policy version, group counts) are whole numbers in bounds.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints

MAX_COUNT = 10**9
"""Largest step, policy version or count a metric or event may carry."""
MAX_FIELDS = 256
"""Most entries in one metric's values or one event's fields."""
MAX_TEXT = 256 * 1024
"""Longest string value of an event field (a step's group ids, joined)."""
NAME_PATTERN = r"^[A-Za-z0-9_./:-]{1,128}$"
"""What an event's name, a field's key and a metric's name look like."""
MAX_STEP_SAMPLES = 32
"""Most samples one step's metric carries for the samples log (`Metric.samples`)."""
MAX_SAMPLE_TEXT = 16 * 1024
"""Longest prompt, response or error text of a logged sample, in characters (the producer clips to its byte cap)."""

COUNTER_KEYS = frozenset({"step", "version", "dropped", "requeued", "lag_max", "read_ahead"})
"""Metric values that are counts (with every `lag_<k>`): whole numbers in [0, MAX_COUNT]."""
_LAG_KEY = re.compile(r"^lag_(\d+)$")


def _infinity_as_nan(value: float) -> float:
    return math.nan if math.isinf(value) else value


Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
"""An event name, a field key or a metric name."""
Value = Annotated[float, AfterValidator(_infinity_as_nan)]
"""A metric value: finite, or NaN (an infinity, an overflowed loss or gradient norm, is kept as NaN)."""
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
"""A string field of an event."""
Int = Annotated[int, Field(ge=-MAX_COUNT * MAX_COUNT, le=MAX_COUNT * MAX_COUNT)]
"""An integer field of an event."""
FieldValue = Text | Int | Value | bool | None
"""One value of an event's fields."""
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
"""A step or a policy version."""


_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_.:-]")


def name_part(text: str, length: int = 64) -> str:
    """`text` as one segment of a metric name: every character outside `[A-Za-z0-9_.:-]` (`/` too) as `_`, at most
    `length` characters; `_` for an empty text."""
    return _NOT_IN_NAME.sub("_", text)[:length] or "_"


def lag_of(key: str) -> int | None:
    """k of a metric value named `lag_<k>` (the number of the step's groups k versions old), else None."""
    m = _LAG_KEY.match(key)
    return int(m.group(1)) if m else None


def check_counters(values: dict[str, float]) -> dict[str, float]:
    """`values`, once every counter among them (`COUNTER_KEYS`, `lag_<k>`) is a whole number in [0, MAX_COUNT]."""
    for key, value in values.items():
        if key not in COUNTER_KEYS and lag_of(key) is None:
            continue
        if math.isnan(value) or value < 0 or value > MAX_COUNT or value != int(value):
            raise ValueError(f"{key} is a count: a whole number in [0, {MAX_COUNT}], got {value!r}")
        if (k := lag_of(key)) is not None and k > MAX_COUNT:
            raise ValueError(f"{key}: a lag of more than {MAX_COUNT} versions")
    return values
