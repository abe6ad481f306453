"""Mapping between numpy dtypes and the core's dtype codes (csrc/common/dtype.h)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .exceptions import InvalidInputError, call_label

(UINT8, INT8, INT32, INT64, FLOAT16, BFLOAT16, FLOAT32, FLOAT64, BOOL, INT16, UINT16, UINT32,
 UINT64) = range(13)

_BY_NAME = {
    "uint8": UINT8,
    "int8": INT8,
    "uint16": UINT16,
    "int16": INT16,
    "uint32": UINT32,
    "int32": INT32,
    "uint64": UINT64,
    "int64": INT64,
    "float16": FLOAT16,
    "bfloat16": BFLOAT16,  # ml_dtypes.bfloat16 (numpy has no native bfloat16)
    "float32": FLOAT32,
    "float64": FLOAT64,
    "bool": BOOL,
}

SUPPORTED = ", ".join(_BY_NAME)


# numpy's dtype.name is slow (microseconds); hashing a dtype is not. Filled lazily
# so that extension dtypes (ml_dtypes.bfloat16) are found by name once.
_BY_DTYPE: dict = {}


def dtype_code(dtype: np.dtype, op: str, name: Optional[str] = None) -> int:
    """Return the core's code for ``dtype`` or raise a helpful InvalidInputError."""
    code = _BY_DTYPE.get(dtype)
    if code is not None:
        return code
    dtype = np.dtype(dtype)
    if not dtype.isnative:
        raise InvalidInputError(
            f"{call_label(op, name)}: dtype {dtype.str} is not in this machine's byte order; "
            "convert first, e.g. x.astype(x.dtype.newbyteorder('='))"
        )
    code = _BY_NAME.get(dtype.name)
    if code is not None:
        _BY_DTYPE[dtype] = code
    else:
        raise InvalidInputError(
            f"{call_label(op, name)}: dtype {dtype.name} is not supported; "
            f"supported dtypes are {SUPPORTED} (convert first, e.g. x.astype(np.int32))"
        )
    return code
