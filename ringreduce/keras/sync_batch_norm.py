"""SyncBatchNormalization: Keras 3 batch normalization with statistics over every rank's batch.

Horovod's ``hvd.SyncBatchNormalization`` (``horovod.tensorflow`` and ``horovod.keras``),
written for Keras 3: a subclass of ``keras.layers.BatchNormalization`` that replaces its
``_moments`` hook, the one place where the training-mode batch mean and variance are
computed. Everything else (moving averages, renorm, inference, the normalization itself)
is BatchNormalization's own code.

In training mode, with more than one rank, the per-channel statistics are those of the
union of all ranks' batches, computed in two Sum allreduces: first every rank's sums and
sample counts (so ranks with different batch sizes, or with masks, weigh by their samples;
Horovod averaged per-rank means and so assumed equal batches), then the sums of squared
deviations from the global mean (exact, without the cancellation of E[x²] - E[x]²). The
allreduces are the backend layer's differentiable ones, so the gradient flows through the
statistics to every rank's inputs, as through one BatchNormalization on the whole batch.

Backends: TensorFlow (eagerly, in ``tf.function`` and ``model.fit``), torch and JAX
(inside the jitted train step), through ``ringreduce.tensorflow``, ``ringreduce.torch`` and
``ringreduce.jax``. Other Keras backends train only at ``size() == 1``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import keras
from keras import ops

from ringreduce import Sum, _binder
from ringreduce.exceptions import InvalidInputError

__all__ = ["SyncBatchNormalization"]

_BACKEND_LAYERS = {"tensorflow": "ringreduce.tensorflow", "torch": "ringreduce.torch",
                   "jax": "ringreduce.jax"}


def _sum_allreduce() -> Callable[[Any], Any]:
    """The differentiable Sum allreduce of the current Keras backend's tensors."""
    backend = keras.backend.backend()
    if backend not in _BACKEND_LAYERS:
        raise InvalidInputError(f"SyncBatchNormalization: the Keras backend {backend!r} is not "
                                f"supported with more than one rank (supported: "
                                f"{', '.join(_BACKEND_LAYERS)})")
    import importlib

    allreduce = importlib.import_module(_BACKEND_LAYERS[backend]).allreduce
    return lambda x: allreduce(x, op=Sum)


@keras.saving.register_keras_serializable(package="ringreduce")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose training statistics span all ranks' batches.

    A drop-in for ``keras.layers.BatchNormalization`` (same arguments, weights and
    saved config). In training mode the mean and variance are those of the union of
    every rank's batch (batches of different sizes and masks included); in inference
    mode, and when ``size() == 1``, it is BatchNormalization.

    Parameters
    ----------
    fused : bool, optional
        Horovod's argument; ``True`` is refused as in Horovod, ``False`` or ``None``
        accepted (Keras 3 has no fused kernel).
    **kwargs :
        ``keras.layers.BatchNormalization``'s arguments. ``synchronized`` is accepted and
        has no effect: the statistics are always synchronized, by ringreduce.

    Notes
    -----
    A training-mode call is collective: every rank must make it, in the same order
    as the other ranks' collectives, and backpropagate through it (the gradient is an
    allreduce too). Backends: TensorFlow, torch, JAX; another backend raises
    ``InvalidInputError`` at the first training call with more than one rank.
    """

    def __init__(self, fused: Optional[bool] = False, **kwargs: Any) -> None:
        if fused:
            raise InvalidInputError("SyncBatchNormalization does not support fused=True")
        kwargs["synchronized"] = False  # Keras's own tf.distribute path: not used here
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple:
        """Mean and variance over every rank's (unmasked) samples, per channel."""
        if _binder()().size() == 1:
            return super()._moments(inputs, mask)
        allreduce = _sum_allreduce()
        axes = self._reduction_axes
        channels = inputs.shape[self.axis]
        shape = [1] * len(inputs.shape)
        shape[self.axis] = channels
        if mask is None:
            keep = None
            count = ops.cast(ops.size(inputs), inputs.dtype) / channels
            count = ops.reshape(count, (1,))
            sums = ops.sum(inputs, axes)
        else:  # as BatchNormalization's masked moments: the mask spans all but the last axis
            keep = ops.cast(ops.broadcast_to(ops.expand_dims(mask, axis=-1),
                                              ops.shape(inputs)), "bool")
            count = ops.sum(ops.cast(keep, inputs.dtype), axes)
            sums = ops.sum(ops.where(keep, inputs, 0), axes)
        totals = allreduce(ops.concatenate([sums, ops.stop_gradient(count)]))
        total = ops.stop_gradient(totals[channels:])
        if keep is not None:
            total = total + keras.backend.epsilon()  # BatchNormalization's masked denominator
        mean = totals[:channels] / total
        centred = inputs - ops.reshape(mean, shape)
        if keep is not None:
            centred = ops.where(keep, centred, 0)
        variance = allreduce(ops.sum(ops.square(centred), axes)) / total
        return mean, variance
