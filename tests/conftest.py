"""Shared fixtures: reference reductions and threaded worlds."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ringreduce as rr
from ringreduce.testing import environ, make_world

DTYPES = [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.bool_]
OPS = [rr.Sum, rr.Average, rr.Min, rr.Max, rr.Product]


def env(**values: str):
    """Temporarily set RINGREDUCE_* variables (read when a Context is created)."""
    return environ(values)


def world(n: int, **settings: str) -> list:
    """``n`` threaded ranks whose Contexts read ``settings`` (RINGREDUCE_* variables)."""
    with env(**settings):
        return make_world(n)


def contribution(rank: int, count: int, dtype, seed: int = 0) -> np.ndarray:
    """Rank-dependent data whose reductions stay exact or well-conditioned."""
    rng = np.random.default_rng(seed * 1000 + rank)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.random(count) < 0.7
    if dt.kind == "u":
        return rng.integers(0, 3, count).astype(dt)
    if dt.kind == "i":
        return rng.integers(-2, 3, count).astype(dt)
    return rng.uniform(0.5, 1.5, count).astype(dt)


def reference(inputs: list, op: int, dtype) -> np.ndarray:
    """Reduce per-rank inputs in float64 (or exact integer) arithmetic."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        stack = np.stack(inputs)
        return stack.any(0) if op in (rr.Sum, rr.Max) else stack.all(0)
    n = len(inputs)
    if dt.kind in "iu":
        return _integer_reference(np.stack([x.astype(np.int64) for x in inputs]), op, n, dt)
    stack = np.stack([x.astype(np.float64) for x in inputs])
    if op == rr.Sum:
        out = stack.sum(0)
    elif op == rr.Average:
        out = stack.sum(0) / n
    elif op == rr.Min:
        out = stack.min(0)
    elif op == rr.Max:
        out = stack.max(0)
    else:
        out = stack.prod(0)
    return out


def _integer_reference(stack: np.ndarray, op: int, n: int, dt: np.dtype) -> np.ndarray:
    """Exact integer reduction, wrapping to the dtype like the kernels do."""
    if op in (rr.Sum, rr.Average):
        out = stack.sum(0)
    elif op == rr.Min:
        out = stack.min(0)
    elif op == rr.Max:
        out = stack.max(0)
    else:
        out = np.ones(stack.shape[1:], np.int64)
        for row in stack:
            out = (out * row).astype(dt).astype(np.int64)
    out = out.astype(dt).astype(np.int64)
    if op == rr.Average:
        out = np.sign(out) * (np.abs(out) // n)
    return out.astype(np.float64)


def tolerance(dtype, op: int, n: int) -> float:
    """Relative tolerance for comparing against the float64 reference."""
    dt = np.dtype(dtype)
    if dt.kind in "iub":
        return 0.0
    if op in (rr.Min, rr.Max):
        return 0.0
    eps = {2: 2 ** -8 if dt.name == "bfloat16" else 2 ** -11, 4: 2 ** -24, 8: 2 ** -53}
    return 4 * n * eps[dt.itemsize]


@pytest.fixture(scope="session")
def tensorflow_scripts(tmp_path_factory):
    """The TensorFlow examples, Horovod's and ours, in one launch (tests/script_jobs.py):
    tests/test_tensorflow_examples.py and test_tensorflow_horovod_examples.py check its
    parts."""
    from procs import require_mpirun
    from script_jobs import tensorflow_job

    require_mpirun()
    return tensorflow_job(tmp_path_factory.mktemp("tensorflow-scripts"))
