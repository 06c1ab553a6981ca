"""Tensors on the wire: `{dtype, shape, data}` with raw little-endian bytes, never Python lists.

Only the standard library is used here; workers turn a `WireTensor` into a torch tensor with
`torch.frombuffer(t.data, dtype=...)`.
"""

from __future__ import annotations

import array
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from schemas.errors import TensorError

DType = Literal["float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]

ITEM_SIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
# array module type codes for the dtypes the standard library can pack and unpack.
_ARRAY_CODE: dict[str, str] = {
    "float32": "f",
    "int64": "q",
    "int32": "i",
    "int16": "h",
    "int8": "b",
    "uint8": "B",
    "bool": "B",
}


class WireTensor(BaseModel):
    """A dense tensor as `dtype` + `shape` + row-major little-endian `data` bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: DType
    """Element type; names follow torch/numpy."""
    shape: tuple[int, ...]
    """Dimensions, outermost first; `()` is a scalar."""
    data: bytes
    """Raw element bytes, `prod(shape) * itemsize` long."""

    @model_validator(mode="after")
    def _check_size(self) -> WireTensor:
        if any(d < 0 for d in self.shape):
            raise TensorError(f"negative dimension in shape {self.shape}")
        want = math.prod(self.shape) * ITEM_SIZE[self.dtype]
        if len(self.data) != want:
            raise TensorError(f"{self.dtype} tensor of shape {self.shape} needs {want} bytes, got {len(self.data)}")
        return self

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_values(
        cls, values: Iterable[float] | Iterable[int], dtype: DType, shape: Sequence[int] | None = None
    ) -> WireTensor:
        """Pack flat Python numbers; `shape` defaults to 1-D."""
        code = _ARRAY_CODE.get(dtype)
        if code is None:
            raise TensorError(f"dtype {dtype} cannot be packed without an array library")
        arr = array.array(code, values)
        if sys.byteorder != "little":
            arr.byteswap()
        return cls(dtype=dtype, shape=tuple(shape) if shape is not None else (len(arr),), data=arr.tobytes())

    def to_values(self) -> list[float] | list[int]:
        """Unpack to a flat list (row-major). For tests and small tensors; workers use torch."""
        code = _ARRAY_CODE.get(self.dtype)
        if code is None:
            raise TensorError(f"dtype {self.dtype} cannot be unpacked without an array library")
        arr = array.array(code)
        arr.frombytes(self.data)
        if sys.byteorder != "little":
            arr.byteswap()
        return arr.tolist()
