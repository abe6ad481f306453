"""Gradient averaging, shared by DistributedGradientTape, the TF1 DistributedOptimizer and
ringreduce.keras's DistributedOptimizer.

Protocol of one averaging (one graph op per call site and step):

* ``None`` gradients stay ``None`` (a variable the loss does not reach, as in one
  process). Every rank traces the same model, so the same gradients are ``None``
  everywhere; if not, the fused group has a different member count on some rank and
  every rank gets a ``MismatchError`` (never a hang).
* Dense gradients (and, with ``sparse_as_dense``, IndexedSlices made dense) are
  compressed, then reduced as **one** grouped allreduce: the engine negotiates them
  as a unit and reduces them in one fused ring, whatever their number.
* IndexedSlices are allgathered (indices and values); Average divides the values.

``LocalAggregation`` adds Horovod's ``backward_passes_per_step=k`` for graphs: the
gradients of k passes are summed in local variables (optionally divided by k) and
averaged across ranks only on every k-th pass; in between nothing is communicated.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any, Callable, Optional

import tensorflow as tf

from ringreduce import Average, Communicator
from ringreduce._adasum import Adasum
from ringreduce._horovod import check_passes, optimizer_scales
from ringreduce._local_grads import LocalVariables
from ringreduce.compression import Compressor
from ringreduce.elastic._client import in_elastic_job
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet

from ._bridge import binder, current_int
from .ops import _allreduce_dense, _allreduce_sparse

__all__ = ["GradientAverager", "LocalAggregation", "average_with_locals", "scale_by_size"]

# Communicator -> kind -> count: per communicator, so ranks that are threads of one
# process (tests) count their own wrappers as separate processes would.
_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def instance_name(kind: str, comm: Communicator) -> str:
    """``kind``, then ``kind.1``, ``kind.2``...: names of the wrappers created on ``comm``,
    in creation order (the same on every rank of one script)."""
    counters = _COUNTERS.setdefault(comm, {})
    n = next(counters.setdefault(kind, itertools.count()))
    return kind if n == 0 else f"{kind}.{n}"


class GradientAverager:
    """Averages a list of gradients over the ranks (see the module docstring).

    Parameters
    ----------
    what : str
        The wrapper's name, for messages and the group's name.
    compression : Compressor
        ``Compression.none`` / ``.fp16`` / ``.bf16``.
    sparse_as_dense : bool
        Reduce IndexedSlices as dense tensors.
    op : int
        ``Average``, ``Sum`` or ``Adasum`` (Horovod's adaptive summation: the gradients are
        combined as they are, IndexedSlices densified first).
    gradient_predivide_factor : float
        With Average: divide by it before the sum, by ``size / factor`` after.
    num_groups, groups :
        Horovod's fusion hints; checked, otherwise ignored (the engine fuses the group).
    unique : bool
        Name the group ``what``, ``what.1``, ... per instance (optimizers, made once),
        rather than ``what`` alone (tapes, made every step: one name keeps the
        engine's response cache warm).
    process_set : ProcessSet, optional
        Average over its members only; a rank outside it keeps its own gradients (as
        Horovod's ``_allreduce_cond``).
    """

    def __init__(self, what: str, compression: type[Compressor], sparse_as_dense: bool,
                 op: int, gradient_predivide_factor: float, num_groups: Any = 0,
                 groups: Any = None, unique: bool = True,
                 process_set: Optional[ProcessSet] = None) -> None:
        adasum = not isinstance(op, bool) and op == Adasum
        if adasum and gradient_predivide_factor != 1.0:
            raise InvalidInputError(f"{what}: gradient_predivide_factor needs op=Average; "
                                    "Adasum combines the gradients as they are")
        self.scales = optimizer_scales(what, Average if adasum else op,
                                       gradient_predivide_factor, num_groups, groups,
                                       "ringreduce.tensorflow")
        if adasum:
            self.scales = (1.0, 1.0)
        self.what, self.op = what, op
        sparse_as_dense = sparse_as_dense or adasum  # Adasum needs whole tensors
        self.compression, self.sparse_as_dense = compression, bool(sparse_as_dense)
        if adasum and process_set is not None and process_set.process_set_id != 0:
            raise InvalidInputError(f"{what}: Adasum runs over every rank (as in Horovod); "
                                    "leave process_set out")
        # the global set is no set: every rank takes part, nothing to ask at each step
        self.process_set = process_set if process_set and process_set.process_set_id else None
        self.get = binder(process_set, "ringreduce.tensorflow")
        # counted on the job's communicator: a non-member makes the same instances
        self.name = instance_name(what, binder()()) if unique else what

    def included(self) -> bool:
        """Whether this rank takes part (a member of the process set, if any)."""
        return self.process_set is None or self.process_set.included()

    def __call__(self, grads: Sequence[Any], marker: Optional[tuple] = None) -> list:
        """The averaged gradients, in order (``None`` stays ``None``); ``marker``: the shape
        of a zero-element member added to the group (``ringreduce._local_grads``)."""
        grads = list(grads)
        if not self.included():
            return grads
        if self.get().size() == 1 and (tf.executing_eagerly() or not in_elastic_job()):
            return grads  # (a traced step of an elastic job may run again at a larger size)
        out: list = [None] * len(grads)
        dense, ctxs = [], []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    out[i] = _allreduce_sparse(g, self.op, f"{self.name}.sparse{i}", self.get)
                    continue
                g = tf.convert_to_tensor(g)
            compressed, ctx = self.compression.compress(g)
            dense.append((i, compressed))
            ctxs.append(ctx)
        members = [t for _, t in dense]
        if marker is not None:
            members.append(tf.zeros(marker, members[0].dtype if members else tf.float32))
        if members:
            reduced = _allreduce_dense(members, self.op, self.name, *self.scales, self.get)
            for (i, _), r, ctx in zip(dense, reduced, ctxs):
                out[i] = self.compression.decompress(r, ctx)
        return out


def scale_by_size(get: Callable[[], Communicator]) -> Callable[[Any], Any]:
    """Horovod's scaling of a local gradient: divided by ``size()`` (IndexedSlices: their
    values); in a graph of an elastic job the size is read when the graph runs."""

    def scale(g: Any) -> Any:
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(scale(g.values), g.indices, g.dense_shape)
        return g / tf.cast(current_int(lambda: get().size(), "size"), g.dtype)

    return scale


def average_with_locals(average: GradientAverager, local: LocalVariables, grads: Sequence[Any],
                        variables: Optional[Sequence[Any]]) -> list:
    """``average(grads)``, except the gradients of ``local``'s variables: kept, and scaled as
    Horovod scales them (``ringreduce._local_grads``)."""
    if not len(local) or not average.included():
        return average(grads)
    return local.combine(grads, variables, average, scale_by_size(average.get))


class LocalAggregation:
    """Horovod's ``backward_passes_per_step`` in a graph: sum k passes locally, reduce on the k-th.

    Parameters
    ----------
    passes : int
        k >= 1.
    average_aggregated : bool
        Divide the local sum by k before it is averaged across ranks (Horovod's
        ``average_aggregated_gradients``).
    what : str
        For messages.
    """

    def __init__(self, passes: int, average_aggregated: bool, what: str) -> None:
        self.passes = check_passes(what, passes)
        self.what = what
        self.average_aggregated = bool(average_aggregated)
        self.counter: Optional[tf.Variable] = None
        self.sums: list = []

    def build(self, grads: Sequence[Any], variables: Optional[Sequence[Any]] = None) -> None:
        """Create the counter and one accumulator per gradient (once; outside any cond)."""
        if self.counter is not None:
            return
        variables = list(variables) if variables is not None else [None] * len(grads)
        # Shapes first: they are static values, which init_scope (eager, or the outer
        # graph) can use; a tf.function's tensors (IndexedSlices.dense_shape) it cannot.
        shapes = [None if g is None else self._shape(g, v) for g, v in zip(grads, variables)]
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                       name="rr_aggregation_counter")
            self.sums = [None if g is None else
                         tf.Variable(tf.zeros(shape, g.dtype), trainable=False,
                                     name="rr_aggregated_gradient")
                         for g, shape in zip(grads, shapes)]

    def _shape(self, grad: Any, variable: Any) -> tf.TensorShape:
        """The dense shape of ``grad``'s accumulator: its variable's static shape, else
        the gradient's own when statically known (an IndexedSlices' ``dense_shape`` is a
        tensor; ``tf.get_static_value`` reads it when it is constant)."""
        shape = tf.TensorShape(None if variable is None else variable.shape)
        if not shape.is_fully_defined():
            if isinstance(grad, tf.IndexedSlices):
                static = tf.get_static_value(grad.dense_shape)
                shape = shape.merge_with(None if static is None else [int(d) for d in static])
            else:
                shape = shape.merge_with(grad.shape)
        if not shape.is_fully_defined():
            raise InvalidInputError(f"{self.what}: backward_passes_per_step needs gradients of "
                                    f"a static shape to accumulate, got {shape}")
        return shape

    def step(self, grads: Sequence[Any], on_update: Callable[[list], Any],
             variables: Optional[Sequence[Any]] = None) -> Any:
        """Accumulate ``grads``; on the k-th pass call ``on_update(local sums)`` and reset.

        ``variables`` (the gradients' variables, in order) give the accumulators' shapes.
        IndexedSlices (embeddings) are added into dense accumulators with a scatter, so
        ``on_update`` receives dense sums (Horovod's aggregation densifies them too).
        Returns the result of a ``tf.cond`` (graph) or of the branch taken (eager).
        """
        self.build(grads, variables)
        adds = [s.scatter_add(g) if isinstance(g, tf.IndexedSlices) else s.assign_add(g)
                for s, g in zip(self.sums, grads) if g is not None]
        with tf.control_dependencies(adds):
            count = self.counter.assign_add(1)

        def update() -> Any:
            scale = 1.0 / self.passes if self.average_aggregated else 1.0
            local = [None if s is None else (s * scale if scale != 1.0 else tf.identity(s))
                     for s in self.sums]
            result = on_update(local)
            with tf.control_dependencies([r for r in tf.nest.flatten(result)
                                          if r is not None] or None):
                resets = [s.assign(tf.zeros_like(s)) for s in self.sums if s is not None]
                return tf.group(resets)

        return tf.cond(tf.equal(count % self.passes, 0), update, tf.no_op)

