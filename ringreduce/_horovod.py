"""Horovod's argument conventions, checked once for every framework layer.

``resolve_op`` turns Horovod's ``average=`` / ``op=`` pair into an op code;
``optimizer_scales`` checks a DistributedOptimizer's (or DistributedGradientTape's)
settings and returns the allreduce's prescale and postscale factors.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

from ._adasum import Adasum
from ._call_checks import _OP_NAMES, Average, Sum, check_scales
from .exceptions import InvalidInputError

__all__ = ["ccl_built", "check_passes", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built",
           "mpi_enabled", "mpi_threads_supported", "not_built", "optimizer_scales",
           "resolve_op", "rocm_built"]


def not_built() -> bool:
    """False: what Horovod's build query asks about is not inside ringreduce."""
    return False


# Horovod's build and backend queries, the same in every framework layer: ringreduce has
# its own TCP/shared-memory transport (no MPI, Gloo, DDL, oneCCL or ROCm inside). CUDA and
# NCCL differ by layer (``ringreduce.cuda_built``/``nccl_built``; TensorFlow's: False).
mpi_built = gloo_built = ddl_built = ccl_built = rocm_built = not_built
mpi_enabled = gloo_enabled = mpi_threads_supported = not_built


def resolve_op(average: Any, op: Optional[int], what: str, module: str = "ringreduce") -> int:
    """The reduction op from Horovod's deprecated ``average=`` flag or ``op=``.

    The second positional argument may also be an op (``allreduce(t, rr.Sum)``,
    as in ``ringreduce.allreduce``).

    Parameters
    ----------
    average : bool, int or None
        Horovod's ``average`` argument (or an op passed in its position).
    op : int or None
        Horovod's ``op`` argument.
    what : str
        The call, for messages.
    module : str
        Where the user finds the ops, for messages.
    """
    if op is not None and average is not None:
        raise InvalidInputError(f"{what}: pass either op= or the deprecated average=, not both")
    if op is None:
        if average is None:
            return Average
        if isinstance(average, bool):
            return Average if average else Sum
        op = average
    try:  # an integer, as the numpy layer requires: 1.0 or 1+0j hash like Average
        code = None if isinstance(op, bool) else operator.index(op)
    except TypeError:
        code = None
    if code == Adasum:
        return Adasum
    if code not in _OP_NAMES:
        raise InvalidInputError(f"{what}: op must be one of {module}.Sum, Average, Min, "
                                f"Max, Product, Adasum; got {op!r}")
    return code


def check_passes(what: str, passes: Any) -> int:
    """``backward_passes_per_step`` as an int >= 1, or InvalidInputError."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise InvalidInputError(f"{what}: backward_passes_per_step must be an int >= 1, got "
                                f"{passes!r}")
    return passes


def optimizer_scales(what: str, op: Any, gradient_predivide_factor: Any,
                     num_groups: Any = 0, groups: Any = None,
                     module: str = "ringreduce") -> tuple[float, float]:
    """Check a gradient-averaging wrapper's settings; return (prescale, postscale).

    With ``op=Average`` the gradients are divided by ``gradient_predivide_factor``
    before the sum and by ``size / factor`` after it (Horovod's semantics); with
    ``Sum`` both factors are 1.

    Parameters
    ----------
    what : str
        The wrapper's name, for messages.
    op : int
        ``Average`` or ``Sum``.
    gradient_predivide_factor : float
        Must be finite and > 0, with a finite inverse; other than 1 only with Average.
    num_groups, groups :
        Horovod's fusion hints: checked for type, otherwise ignored.
    module : str
        Where the user finds the ops, for messages.
    """
    if isinstance(op, bool) or op not in (Average, Sum):
        raise InvalidInputError(f"{what}: op must be {module}.Average or Sum, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise InvalidInputError(f"{what}: gradient_predivide_factor needs op=Average")
    try:
        predivide = check_scales(gradient_predivide_factor, 1.0, what)[0]
    except InvalidInputError:
        predivide = math.nan
    if not (predivide > 0 and math.isfinite(predivide) and math.isfinite(1.0 / predivide)):
        raise InvalidInputError(f"{what}: gradient_predivide_factor must be a finite number > 0 "
                                f"whose inverse is finite, got {gradient_predivide_factor!r}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise InvalidInputError(f"{what}: num_groups must be an int >= 0, got {num_groups!r}")
    if groups is not None and not isinstance(groups, (int, list, tuple)):
        raise InvalidInputError(f"{what}: groups must be None, an int or a list of lists of "
                                f"variables, got {type(groups).__name__}")
    return (1.0 / predivide, predivide) if op == Average else (1.0, 1.0)
