"""DistributedGradientTape: ``tape.gradient`` returns gradients averaged over all ranks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ringreduce import Average
from ringreduce.compression import Compressor
from ringreduce.exceptions import InvalidInputError

from .compression import Compression
from .gradients import GradientAverager

__all__ = ["DistributedGradientTape"]

_CLASSES: dict = {}


class _DistributedTapeMixin:
    """Put in front of the tape's class: ``gradient`` averages what the tape computed."""

    _rr_average: GradientAverager

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The tape's gradients of ``target`` w.r.t. ``sources``, averaged over all ranks
        (same nesting as ``sources``; ``None`` where the target does not depend on one)."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, self._rr_average(flat),
                                        expand_composites=False)


def DistributedGradientTape(gradtape: tf.GradientTape,  # noqa: N802 (Horovod's name)
                            device_dense: str = "", device_sparse: str = "",
                            compression: type[Compressor] = Compression.none,
                            sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None) -> tf.GradientTape:
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` averages over all ranks.

    The result is an instance of a subclass of the tape's class sharing its
    recording, so it works after the ``with`` block (Horovod's recipe) or as the
    context manager itself. All gradients of one ``gradient()`` call are reduced
    as one fused group; IndexedSlices are allgathered (or made dense with
    ``sparse_as_dense=True``).

    Parameters
    ----------
    gradtape : tf.GradientTape
        The tape.
    device_dense, device_sparse : str
        Horovod's; ignored (tensors are reduced where they lie).
    compression : Compressor
        ``Compression.none`` (default), ``.fp16`` or ``.bf16``.
    sparse_as_dense : bool
        Reduce IndexedSlices gradients as dense tensors.
    op : int
        ``Average`` (default) or ``Sum``.
    gradient_predivide_factor : float
        With Average: divide before the sum by this, after it by ``size / factor``.
    num_groups, groups :
        Horovod's fusion hints; accepted and ignored (one fused group per call).

    Returns
    -------
    tf.GradientTape
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise InvalidInputError(f"DistributedGradientTape: expected a tf.GradientTape, got "
                                f"{type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedTapeMixin):
        raise InvalidInputError("DistributedGradientTape: this tape is already distributed")
    base = type(gradtape)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(base.__name__, (_DistributedTapeMixin, base),
                                    {"__module__": base.__module__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._rr_average = GradientAverager("DistributedGradientTape", compression,
                                        sparse_as_dense, op, gradient_predivide_factor,
                                        num_groups, groups, unique=False)
    return tape
