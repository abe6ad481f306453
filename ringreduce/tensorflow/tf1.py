"""TF1-style graphs through ``tf.compat.v1``: DistributedOptimizer and the broadcast hook.

The classic distributed-TensorFlow script (placeholders, a ``tf.compat.v1.train``
optimizer, ``MonitoredTrainingSession``) keeps its shape (``op=Adasum`` gives Horovod's
delta optimizer, ``DistributedAdasumTF1Optimizer``)::

    opt = rr.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01 * rr.size()))
    train_op = opt.minimize(loss, global_step=global_step)
    hooks = [rr.BroadcastGlobalVariablesHook(0)]
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=ckpt_dir if rr.rank() == 0 else None, hooks=hooks) as sess:
        ...
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from ringreduce import Average
from ringreduce._adasum import Adasum
from ringreduce._horovod import check_passes
from ringreduce._local_grads import LocalVariables
from ringreduce.compression import Compressor
from ringreduce.process_sets import ProcessSet

from ._bridge import binder, run_translated
from .compression import Compression
from .gradients import GradientAverager, LocalAggregation, average_with_locals, instance_name
from .ops import _allreduce_dense
from .variables import broadcast_global_variables

__all__ = ["BroadcastGlobalVariablesHook", "DistributedAdasumTF1Optimizer",
           "DistributedTF1Optimizer"]


class DistributedTF1Optimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose gradients are averaged over all ranks.

    ``compute_gradients`` returns averaged gradients (one fused allreduce for all of
    them); ``apply_gradients`` and everything else are the wrapped optimizer's. With
    ``backward_passes_per_step=k > 1`` the gradients are instead summed locally and
    ``apply_gradients`` averages and applies them on every k-th run only. Variables
    registered with ``register_local_var`` keep this rank's gradients (Horovod's model
    parallelism; ``ringreduce._local_grads``).
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: Any = None,
                 use_locking: bool = False, compression: type[Compressor] = Compression.none,
                 sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                 op: int = Average, gradient_predivide_factor: float = 1.0,
                 average_aggregated_gradients: bool = False, num_groups: int = 0,
                 groups: Any = None, scale_local_gradients: bool = True,
                 process_set: Optional[ProcessSet] = None) -> None:
        self._optimizer = optimizer
        self._local = LocalVariables("DistributedOptimizer", scale_local_gradients)
        self._average = GradientAverager("DistributedOptimizer", compression, sparse_as_dense,
                                         op, gradient_predivide_factor, num_groups, groups,
                                         process_set=process_set)
        self._aggregation = LocalAggregation(backward_passes_per_step,
                                             average_aggregated_gradients,
                                             "DistributedOptimizer")
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                         use_locking=use_locking)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's (gradient, variable) pairs, gradients averaged over ranks
        (with ``backward_passes_per_step > 1``: this rank's, see ``apply_gradients``)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if self._aggregation.passes > 1:
            return pairs
        variables = [v for _, v in pairs]
        grads = average_with_locals(self._average, self._local, [g for g, _ in pairs],
                                    variables)
        return list(zip(grads, variables))

    def register_local_var(self, var: Any) -> None:
        """Horovod's: keep this rank's own gradient of ``var`` (not reduced across ranks;
        divided by ``size()`` with ``scale_local_gradients=True``)."""
        self._local.register(var)

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: Any = None) -> Any:
        """Apply with the wrapped optimizer (every k-th run, averaged, when k > 1)."""
        pairs = list(grads_and_vars)
        if self._aggregation.passes == 1:
            return self._optimizer.apply_gradients(pairs, global_step, name)
        variables = [v for _, v in pairs]

        def update(local: list) -> Any:
            averaged = average_with_locals(self._average, self._local, local, variables)
            return self._optimizer.apply_gradients(list(zip(averaged, variables)), global_step,
                                                   name)

        return self._aggregation.step([g for g, _ in pairs], update, variables)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


class DistributedAdasumTF1Optimizer(tf.compat.v1.train.Optimizer):
    """Horovod's ``DistributedOptimizer(op=Adasum)`` for TF1 graphs: the delta optimizer.

    Every rank applies its own gradients with the wrapped optimizer; then the change
    each rank made to its variables since the last combination (the *delta*) is
    combined across ranks with Adasum (``ringreduce._adasum``; one grouped allreduce of
    all deltas, each combined on its own), and every rank sets its variables to the
    start plus the combination. So the learning rate means what it means in one
    process (Horovod's example does not scale it by ``size()`` with Adasum). With
    ``backward_passes_per_step=k`` the combination happens on every k-th step only and
    the steps between are local (Horovod's semantics).

    The starts are a slot ``"delta_start"`` per variable (set from the variable on the
    first step, so after ``BroadcastGlobalVariablesHook``), and the step count a
    variable: both are global variables, saved in checkpoints and broadcast by the hook;
    ``variables()`` returns them with the wrapped optimizer's (Horovod's returns only
    the latter).
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: Any = None,
                 use_locking: bool = False, compression: type[Compressor] = Compression.none,
                 backward_passes_per_step: int = 1) -> None:
        what = "DistributedOptimizer(op=Adasum)"
        self._optimizer = optimizer
        self._compression = compression
        self._passes = check_passes(what, backward_passes_per_step)
        self._get = binder()
        self._group = instance_name("DistributedOptimizer.adasum", self._get())
        self._step_count: Any = None
        super().__init__(name=name or f"DistributedDelta{type(optimizer).__name__}",
                         use_locking=use_locking)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's gradients, as they are (the deltas are combined)."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: Any = None) -> Any:
        """Apply locally, then (on every k-th step) combine the deltas with Adasum."""
        pairs = list(grads_and_vars)
        variables = [v for g, v in pairs if g is not None]
        with tf.init_scope():
            if self._step_count is None:
                self._step_count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                               name=f"{self._name}_step_count")
            starts = [self._zeros_slot(v, "delta_start", self._name) for v in variables]
        first = tf.equal(self._step_count, 0)
        init = tf.cond(first, lambda: tf.group([s.assign(v.read_value())
                                                for s, v in zip(starts, variables)]),
                       tf.no_op)
        with tf.control_dependencies([init]):
            update = self._optimizer.apply_gradients(pairs, global_step, name)
        with tf.control_dependencies([update]):
            # Created after the update, so the branches (which hang off it) read the
            # variables as the local step left them.
            combine_now = tf.equal(self._step_count % self._passes, self._passes - 1)

        def combine() -> Any:
            deltas = [v.read_value() - s for v, s in zip(variables, starts)]
            packed = [self._compression.compress(d) for d in deltas]
            combined = _allreduce_dense([t for t, _ in packed], Adasum, self._group, 1.0, 1.0,
                                        self._get)
            new_starts = [s.assign_add(self._compression.decompress(c, ctx))
                          for s, c, (_, ctx) in zip(starts, combined, packed)]
            return tf.group([v.assign(n) for v, n in zip(variables, new_starts)])

        sync = tf.cond(combine_now, combine, tf.no_op) if variables else tf.no_op()
        with tf.control_dependencies([sync]):
            return self._step_count.assign_add(1).op if not tf.executing_eagerly() \
                else self._step_count.assign_add(1)

    def get_slot(self, var: Any, name: str) -> Any:
        """``"delta_start"``, or the wrapped optimizer's slot."""
        own = super().get_slot(var, name)
        return own if own is not None else self._optimizer.get_slot(var, name)

    def get_slot_names(self) -> list:
        """``"delta_start"`` and the wrapped optimizer's slot names."""
        return super().get_slot_names() + self._optimizer.get_slot_names()

    def variables(self) -> list:
        """The wrapped optimizer's variables, the delta starts and the step count."""
        own = [self._step_count] if self._step_count is not None else []
        starts = list(self._slots.get("delta_start", {}).values())
        return self._optimizer.variables() + starts + own


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcast every global variable from ``root_rank`` once the session is created
    (and after it restored a checkpoint), so every rank starts from the same state.

    Parameters
    ----------
    root_rank : int
        The rank whose values win.
    device : str
        Horovod's; ignored.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None

    def begin(self) -> None:
        """Build the broadcast op in the session's graph."""
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        """Run the broadcast (ringreduce's own error, not TensorFlow's, if it fails)."""
        run_translated(session.run, self.bcast_op)
