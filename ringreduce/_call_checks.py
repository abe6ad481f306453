"""Argument checks and names shared by the collectives of every layer (numpy, torch, TF)."""

from __future__ import annotations

import math
import operator
import reprlib
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from .exceptions import InvalidInputError, call_label

Sum, Average, Min, Max, Product = 0, 1, 2, 3, 4
_OP_NAMES = {Sum: "Sum", Average: "Average", Min: "Min", Max: "Max", Product: "Product"}
# Adasum (5) is routed by the allreduce calls that accept it (``_composite_calls._adasum``).


def _check_op(op: Any, what: str) -> int:
    """The op as a plain int; InvalidInputError unless it is an integer naming an op
    (1.0 or 1+0j hash like 1, so a dict lookup alone would let them through)."""
    if type(op) is int and op in _OP_NAMES:
        return op
    try:
        code = operator.index(op)  # ints, bools, IntEnums, numpy integers
    except TypeError:
        code = None
    if code not in _OP_NAMES:
        raise InvalidInputError(f"{what}: op must be one of ringreduce.Sum, Average, Min, Max, "
                                f"Product; got {reprlib.repr(op)}")
    return code


_TEXT = (str, bytes, bytearray)  # float() parses them; as a scale factor, text is a mistake


def check_scales(prescale: Any, postscale: Any, op: str,
                 name: Optional[str] = None) -> tuple[float, float]:
    """The scale factors as floats; InvalidInputError unless both are finite real numbers.

    Parameters
    ----------
    prescale, postscale : Any
        What the caller passed as ``prescale_factor`` and ``postscale_factor``.
    op, name : str
        The call and tensor, for the message.
    """
    try:
        pre, post = float(prescale), float(postscale)
    except (TypeError, ValueError, OverflowError):
        pre = post = math.nan
    if math.isfinite(pre) and math.isfinite(post) and not isinstance(prescale, _TEXT) \
            and not isinstance(postscale, _TEXT):
        return pre, post
    raise InvalidInputError(f"{call_label(op, name)}: prescale_factor and postscale_factor "
                            f"must be finite real numbers, got {reprlib.repr(prescale)} and "
                            f"{reprlib.repr(postscale)}")


def _members(xs: Sequence[Any], what: str) -> list:
    if isinstance(xs, np.ndarray) or not isinstance(xs, Sequence) or not xs:
        raise InvalidInputError(f"{what}: expects a non-empty list of arrays, got "
                                f"{reprlib.repr(xs)}")
    return list(xs)


def _part(name: Optional[str], part: str) -> Optional[str]:
    """Name of one step of a composite call; unnamed stays unnamed (matched by order)."""
    return None if name is None else f"{name}.{part}"
