"""DistributedGradientTape: ``tape.gradient`` returns gradients averaged over all ranks;
PartialDistributedGradientTape: except those of local layers (``ringreduce._local_grads``)."""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from ringreduce import Average
from ringreduce._local_grads import LocalVariables, local_layer_variables
from ringreduce.compression import Compressor
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import ProcessSet

from .compression import Compression
from .gradients import GradientAverager, average_with_locals

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]

_CLASSES: dict = {}


class _DistributedTapeMixin:
    """Put in front of the tape's class: ``gradient`` averages what the tape computed."""

    _rr_average: GradientAverager
    _rr_local: LocalVariables

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The tape's gradients of ``target`` w.r.t. ``sources``, averaged over all ranks
        (same nesting as ``sources``; ``None`` where the target does not depend on one),
        except those of registered local sources (see ``register_local_source``)."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        variables = tf.nest.flatten(sources, expand_composites=False) if len(self._rr_local) \
            else None
        return tf.nest.pack_sequence_as(
            grads, average_with_locals(self._rr_average, self._rr_local, flat, variables),
            expand_composites=False)

    def register_local_source(self, source: Any) -> None:
        """Horovod's: keep this rank's own gradient of ``source`` (a variable of a
        model-parallel layer), not reduced across ranks; divided by ``size()`` when the tape
        was made with ``scale_local_gradients=True``. Every rank must register the same
        positions among the sources (else ``MismatchError``; see ``ringreduce._local_grads``).
        """
        self._rr_local.register(source)


def DistributedGradientTape(gradtape: tf.GradientTape,  # noqa: N802 (Horovod's name)
                            device_dense: str = "", device_sparse: str = "",
                            compression: type[Compressor] = Compression.none,
                            sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: Optional[ProcessSet] = None,
                            scale_local_gradients: bool = True, *,
                            _what: str = "DistributedGradientTape") -> tf.GradientTape:
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
    process_set : ProcessSet, optional
        Average over its members only; on a rank outside it ``gradient()`` returns the
        rank's own gradients (as Horovod).
    scale_local_gradients : bool
        Divide the gradients of sources registered with ``register_local_source`` (which
        are not reduced) by ``size()``, as Horovod does.

    Returns
    -------
    tf.GradientTape
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise InvalidInputError(f"{_what}: expected a tf.GradientTape, got "
                                f"{type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedTapeMixin):
        raise InvalidInputError(f"{_what}: this tape is already distributed")
    local = LocalVariables(_what, scale_local_gradients)
    base = type(gradtape)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(base.__name__, (_DistributedTapeMixin, base),
                                    {"__module__": base.__module__})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._rr_average = GradientAverager("DistributedGradientTape", compression,
                                        sparse_as_dense, op, gradient_predivide_factor,
                                        num_groups, groups, unique=False,
                                        process_set=process_set)
    tape._rr_local = local
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape,  # noqa: N802 (Horovod's name)
                                   device_dense: str = "", device_sparse: str = "",
                                   compression: type[Compressor] = Compression.none,
                                   sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: Optional[ProcessSet] = None,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """Horovod's model-parallel tape: ``DistributedGradientTape`` whose gradients of the
    ``local_layers``' trainable variables stay this rank's own (not reduced; divided by
    ``size()`` with ``scale_local_gradients=True``).

    Parameters
    ----------
    gradtape : tf.GradientTape
        The tape.
    local_layers : keras.layers.Layer or list of them, optional
        Layers whose trainable variables are registered with ``register_local_source``.
        ``None``: the tape is a ``DistributedGradientTape``.
    scale_local_gradients : bool
        Divide the local gradients by ``size()`` (Horovod's default).
    device_dense, device_sparse, compression, sparse_as_dense, op, gradient_predivide_factor, \
num_groups, groups, process_set :
        As for ``DistributedGradientTape``.

    Returns
    -------
    tf.GradientTape
    """
    what = "PartialDistributedGradientTape"
    import keras

    local_vars = local_layer_variables(what, local_layers, keras.layers.Layer)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients, _what=what)
    for var in local_vars:
        tape.register_local_source(var)
    return tape
