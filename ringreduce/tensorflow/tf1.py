"""TF1-style graphs through ``tf.compat.v1``: DistributedOptimizer and the broadcast hook.

The classic distributed-TensorFlow script (placeholders, a ``tf.compat.v1.train``
optimizer, ``MonitoredTrainingSession``) keeps its shape::

    opt = rr.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01 * rr.size()))
    train_op = opt.minimize(loss, global_step=global_step)
    hooks = [rr.BroadcastGlobalVariablesHook(0)]
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=ckpt_dir if rr.rank() == 0 else None, hooks=hooks) as sess:
        ...
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ringreduce import Average
from ringreduce.compression import Compressor

from ._bridge import run_translated
from .compression import Compression
from .gradients import GradientAverager, LocalAggregation
from .variables import broadcast_global_variables

__all__ = ["BroadcastGlobalVariablesHook", "DistributedTF1Optimizer"]


class DistributedTF1Optimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose gradients are averaged over all ranks.

    ``compute_gradients`` returns averaged gradients (one fused allreduce for all of
    them); ``apply_gradients`` and everything else are the wrapped optimizer's. With
    ``backward_passes_per_step=k > 1`` the gradients are instead summed locally and
    ``apply_gradients`` averages and applies them on every k-th run only.
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: Any = None,
                 use_locking: bool = False, compression: type[Compressor] = Compression.none,
                 sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                 op: int = Average, gradient_predivide_factor: float = 1.0,
                 average_aggregated_gradients: bool = False, num_groups: int = 0,
                 groups: Any = None) -> None:
        self._optimizer = optimizer
        self._average = GradientAverager("DistributedOptimizer", compression, sparse_as_dense,
                                         op, gradient_predivide_factor, num_groups, groups)
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
        grads = self._average([g for g, _ in pairs])
        return list(zip(grads, [v for _, v in pairs]))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: Any = None) -> Any:
        """Apply with the wrapped optimizer (every k-th run, averaged, when k > 1)."""
        pairs = list(grads_and_vars)
        if self._aggregation.passes == 1:
            return self._optimizer.apply_gradients(pairs, global_step, name)
        variables = [v for _, v in pairs]

        def update(local: list) -> Any:
            averaged = self._average(local)
            return self._optimizer.apply_gradients(list(zip(averaged, variables)), global_step,
                                                   name)

        return self._aggregation.step([g for g, _ in pairs], update)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


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
