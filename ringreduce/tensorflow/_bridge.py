"""Plumbing of ringreduce.tensorflow: collectives as graph ops, tensors as arrays without copies.

Nothing here is compiled against TensorFlow. A collective is one ``tf.py_function``
whose body hands its inputs to the C++ engine and returns the engine's results, so the
same op runs eagerly, inside ``tf.function`` (``model.fit``'s steps) and in
``tf.compat.v1`` graphs. XLA cannot compile a Python call: a ``jit_compile=True``
function that contains a collective fails to compile (Keras picks XLA only on GPUs).

Zero copies on the way in and out, measured in ``tests/test_tensorflow_ops.py``:

* in: an eager CPU tensor is viewed as a numpy array through DLPack
  (``np.from_dlpack``), read-only, sharing the tensor's buffer;
* out: results are written by the engine into 64-byte-aligned numpy arrays
  (``ringreduce._arrays.empty_aligned``) which TensorFlow adopts through DLPack
  (less aligned memory it would copy), and ``tf.py_function`` passes them on as they are.

bfloat16 crosses as int16 bits (``tf.bitcast`` outside the Python call, a
``ml_dtypes.bfloat16`` view inside): DLPack has no bfloat16 for numpy.

Errors: the body's ``RingReduceError`` becomes a TensorFlow ``OpError`` whose message
carries ours; ``translate`` finds the original exception again (kept in a small
registry, ``ringreduce._wrapped_errors``), so eager calls, ``model.fit`` (through
ringreduce.keras's callbacks) and ``run_translated`` re-raise ``PeerLostError``,
``MismatchError``... themselves.
"""

from __future__ import annotations

import itertools
import os
import sys
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

import ringreduce as _rr
from ringreduce import _wrapped_errors
from ringreduce._arrays import ALIGNMENT
from ringreduce._dtypes import SUPPORTED, dtype_code
from ringreduce.exceptions import InvalidInputError, RingReduceError

__all__ = ["binder", "call", "check_tensor", "comm", "current_int", "graph_name", "run_translated",
           "translate", "translated"]

comm = _rr._comm
binder = _rr._binder
Body = Callable[[list], Sequence[np.ndarray]]

# tf.compat.v1 graph -> count of the unnamed collectives built in it (see graph_name).
_GRAPH_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _bfloat16() -> Any:
    import ml_dtypes  # a dependency of TensorFlow itself

    return ml_dtypes.bfloat16


def check_tensor(t: Any, what: str) -> tf.Tensor:
    """``t`` as a tensor of a dtype the engine reduces, or a clear InvalidInputError."""
    if isinstance(t, tf.IndexedSlices):
        raise InvalidInputError(f"{what}: got tf.IndexedSlices; convert it with "
                                "tf.convert_to_tensor, or use allreduce (which gathers them)")
    if not tf.is_tensor(t):
        try:
            t = tf.convert_to_tensor(t)
        except (TypeError, ValueError) as err:
            raise InvalidInputError(f"{what}: expected a tensor, got {type(t).__name__} "
                                    f"({err})") from err
    if t.dtype == tf.bfloat16:
        return t
    if t.dtype in (tf.string, tf.resource, tf.variant) or not t.dtype.is_numpy_compatible:
        raise InvalidInputError(f"{what}: dtype {t.dtype.name} is not supported; supported "
                                f"dtypes are {SUPPORTED} (cast first, e.g. "
                                "tf.cast(x, tf.int32))")
    dtype_code(np.dtype(t.dtype.as_numpy_dtype), what)  # raises for complex...
    return t


def _to_array(t: tf.Tensor, bf16: bool) -> np.ndarray:
    """A read-only numpy view of an eager CPU tensor (DLPack: no copy)."""
    a = np.from_dlpack(t)
    return a.view(_bfloat16()) if bf16 else a


def _to_tensor(a: np.ndarray, bf16: bool) -> tf.Tensor:
    """A tensor over ``a``'s memory when it is aligned and contiguous (otherwise a copy)."""
    if bf16:
        a = a.view(np.int16)
    if a.flags.c_contiguous and a.ctypes.data % ALIGNMENT == 0:
        return tf.experimental.dlpack.from_dlpack(a.__dlpack__())
    return tf.convert_to_tensor(a)


# -------------------------------------------------------------------- errors
def translate(err: BaseException) -> BaseException:
    """The RingReduceError behind a TensorFlow ``OpError`` raised by a collective, or ``err``."""
    if isinstance(err, tf.errors.OpError):
        found = _wrapped_errors.find(err.message)
        if found is not None:
            return found
    return err


@contextmanager
def translated() -> Iterator[None]:
    """Re-raise a collective's RingReduceError itself instead of TensorFlow's wrapper."""
    try:
        yield
    except tf.errors.OpError as err:
        original = translate(err)
        if original is err:
            raise
        raise original.with_traceback(None) from err


def run_translated(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` (e.g. a ``tf.function`` or a Session's ``run``), re-raising the
    RingReduceError of a failed collective inside it as itself.

    Parameters
    ----------
    fn : callable
        What to run.
    *args, **kwargs
        Its arguments.
    """
    with translated():
        return fn(*args, **kwargs)


# -------------------------------------------------------------------- names
def graph_name(kind: str, name: Optional[str]) -> Optional[str]:
    """``name``, or for an unnamed collective built into a ``tf.compat.v1`` graph a name
    fixed now: ``kind.tf1.<n>``, the n-th unnamed collective built into that graph.

    Unnamed collectives are matched across ranks by the order in which they run. That
    order is the program's eagerly and inside ``tf.function`` (whose automatic control
    dependencies run stateful ops in program order), where ``None`` is returned. A v1
    graph has no such dependencies: the independent collectives of one ``session.run``
    run in any order, which may differ between ranks. Every rank builds the same graph,
    so a name given at build time pairs them whatever the order, as Horovod's (named
    after the graph op) does.

    Parameters
    ----------
    kind : str
        The call, e.g. ``"allreduce"``.
    name : str, optional
        The caller's name, returned as it is.

    Returns
    -------
    str or None
    """
    if tf.executing_eagerly():
        return name
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "experimental_acd_manager", None) is not None:
        return name  # tf.function (or a branch of one): the run order is the program's
    # A tf.cond / tf.while_loop branch is a graph of its own, nested in the v1 graph:
    # count in the outermost one, so that two branches never share a name.
    while getattr(graph, "outer_graph", None) is not None:
        graph = graph.outer_graph
    n = next(_GRAPH_COUNTERS.setdefault(graph, itertools.count()))
    _warn_if_threads_may_run_out(graph, n + 1)
    return name if name is not None else f"{kind}.tf1.{n}"


_WARNED_GRAPHS: weakref.WeakSet = weakref.WeakSet()


def _warn_if_threads_may_run_out(graph: Any, collectives: int) -> None:
    """Warn once per v1 graph that holds more collective ops than TensorFlow has inter-op
    threads. Each op blocks its thread until every rank has submitted it (the ops are
    py_functions; Horovod's were asynchronous kernels, which ringreduce does not compile
    against TensorFlow): a session.run that starts more of them than there are threads,
    in different orders on different ranks, leaves every thread waiting for a collective
    whose input another rank cannot compute (measured: 8 independent allreduces with 2
    threads hang; the engine's stall warning names them after 60 s)."""
    threads = tf.config.threading.get_inter_op_parallelism_threads() or os.cpu_count() or 1
    if collectives <= threads or graph in _WARNED_GRAPHS:
        return
    _WARNED_GRAPHS.add(graph)
    warnings.warn(
        f"ringreduce.tensorflow: this tf.compat.v1 graph now holds {collectives} collective "
        f"ops, more than TensorFlow's {threads} inter-op threads. Each op holds a thread "
        "until every rank has submitted it, so a session.run that starts more of them "
        "than there are threads, in different orders on different ranks, can deadlock. "
        "Fuse them into one op (grouped_allreduce; DistributedOptimizer and "
        "broadcast_global_variables already do), or give TensorFlow more inter-op "
        "threads (tf.config.threading.set_inter_op_parallelism_threads(n) before any "
        "op runs, or ConfigProto(inter_op_parallelism_threads=n) for the first session)",
        RuntimeWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, called here, of the first caller that is not
    ringreduce, TensorFlow or Keras (the user's line that built the op)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and \
            str(frame.f_globals.get("__name__", "")).split(".")[0] in _LIBRARIES:
        frame, level = frame.f_back, level + 1
    return level


_LIBRARIES = ("ringreduce", "tensorflow", "keras", "tf_keras")


# -------------------------------------------------------------------- the op
def call(body: Body, inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
         what: str) -> list:
    """Run ``body(arrays) -> arrays`` on the engine as one graph op.

    Parameters
    ----------
    body : callable
        Receives numpy views of ``inputs`` (in an eager context, on whichever thread
        TensorFlow runs the op) and returns one numpy array per ``out_dtypes``.
    inputs : sequence of tf.Tensor
        Checked with ``check_tensor``.
    out_dtypes : sequence of tf.DType
        The outputs' dtypes.
    what : str
        The call and tensor, for messages.

    Returns
    -------
    list of tf.Tensor
        Shapes are unknown to the graph: callers set what they know.
    """
    in_bf16 = [t.dtype == tf.bfloat16 for t in inputs]
    out_bf16 = [d == tf.bfloat16 for d in out_dtypes]
    wire = [tf.bitcast(t, tf.int16) if b else t for t, b in zip(inputs, in_bf16)]

    def run(*tensors: tf.Tensor) -> list:
        arrays = [_to_array(t, b) for t, b in zip(tensors, in_bf16)]
        try:
            outs = body(arrays)
        except RingReduceError as err:
            _wrapped_errors.remember(err)
            raise
        return [_to_tensor(np.asarray(a), b) for a, b in zip(outs, out_bf16)]

    touts = [tf.int16 if b else d for d, b in zip(out_dtypes, out_bf16)]
    if tf.executing_eagerly() and all(t.device.endswith("CPU:0") for t in wire):
        # Eagerly, the op would only run `run` on this thread; a py_function around it
        # cost ~0.4 ms per call, most of a metric's allreduce. Errors raise as they are.
        # (A tf.Variable is read into a tensor first, as the py_function would.)
        outs = run(*[t if isinstance(t, tf.Tensor) else tf.convert_to_tensor(t) for t in wire])
    else:
        with translated():
            outs = tf.py_function(run, wire, touts, name=_op_name(what))
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return [tf.bitcast(o, tf.bfloat16) if b else o for o, b in zip(outs, out_bf16)]


def current_int(value: Callable[[], int], name: str) -> tf.Tensor:
    """``value()`` as an int32 tensor: a constant, except in a graph of an elastic job, where
    it is read each time the graph runs (``size()`` changes at each reset, and a traced
    ``tf.function`` outlives it, as Horovod's ``size_op`` in elastic mode)."""
    from ringreduce.elastic._client import in_elastic_job

    if tf.executing_eagerly() or not in_elastic_job():
        return tf.constant(value(), tf.int32, name=name)
    out = tf.py_function(lambda: np.int32(value()), [], tf.int32, name=_op_name(name))
    out.set_shape([])
    return out


def _op_name(what: str) -> str:
    """A graph-op name from a label such as ``allreduce 'grad.0'``."""
    cleaned = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in what)
    return "ringreduce_" + cleaned.strip("_")[:60]
