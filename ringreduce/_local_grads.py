"""Worker-local variables (Horovod's model-parallel "local layers"), for every framework layer.

A variable registered as local (``register_local_source`` on a tape, ``register_local_var`` on
an optimizer, or the ``local_layers`` of the ``Partial...`` wrappers) keeps this rank's own
gradient: it is left out of the gradient allreduce. With ``scale_local_gradients=True`` (the
default) that gradient is divided by ``size()``, whatever the op (Average, Sum, Adasum) and the
``gradient_predivide_factor`` (Horovod 0.28: ``horovod/tensorflow/__init__.py``, the tape's
``gradient`` and ``_DistributedOptimizer.compute_gradients``; ``horovod/_keras/__init__.py``;
``horovod/tensorflow/gradient_aggregation*.py`` with ``backward_passes_per_step``: the
local sum of the k passes, divided by ``size()``, then by k with
``average_aggregated_gradients``). Horovod's reason (pull/3695): the loss a rank
differentiates is its share of a global mean, so a local layer's gradient is that of the
global objective over ``size()`` ranks.

Names. The gradients that are still reduced keep the wrapper's group name and are members
by their position among the reduced ones, so every rank must register the same positions
(the usual case: the same model on every rank, some of whose layers hold different, even
differently shaped, values per rank). When any gradient of a call is local, the group gets
one more member, a zero-element tensor whose shape is a digest of the local positions
(``layout_shape``): ranks that registered different positions then fail with a
``MismatchError`` on every rank (the engine compares shapes) instead of silently averaging
one rank's layer with another's. No bytes travel for it.

The framework layers supply the arithmetic (``scale``) and the reduction; this module keeps
the bookkeeping: which variables are local, where they sit in a call, the digest.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, Callable, Optional

from .exceptions import InvalidInputError

__all__ = ["LocalVariables", "layout_shape", "local_layer_variables"]


def _identities(var: Any) -> tuple:
    """``id`` of ``var`` and, for a Keras variable, of the backend variable it wraps (a tape
    or an optimizer may be handed either)."""
    inner = getattr(var, "_value", None) if type(var).__module__.startswith("keras") else None
    return (id(var),) if inner is None else (id(var), id(inner))


def layout_shape(count: int, local: Sequence[int]) -> tuple:
    """The shape of the zero-element marker for ``local`` positions among ``count``
    gradients: ``(0, a, b)`` with a, b from a CRC-32 of both (equal on ranks that agree)."""
    digest = zlib.crc32(repr((int(count), tuple(int(i) for i in local))).encode())
    return (0, (digest & 0xFFFF) + 1, (digest >> 16) + 1)


class LocalVariables:
    """The variables registered as local on one tape or optimizer.

    Parameters
    ----------
    what : str
        The wrapper's name, for messages.
    scale_local_gradients : bool
        Divide local gradients by ``size()`` (Horovod's default, True).
    """

    def __init__(self, what: str, scale_local_gradients: bool = True) -> None:
        if not isinstance(scale_local_gradients, bool):
            raise InvalidInputError(f"{what}: scale_local_gradients must be True or False, got "
                                    f"{scale_local_gradients!r}")
        self.what = what
        self.scale = scale_local_gradients
        self._held: dict = {}  # id -> object: the objects stay alive, so their ids stay theirs

    def register(self, var: Any) -> None:
        """Mark ``var`` local: its gradient is not reduced across ranks."""
        if var is None:
            raise InvalidInputError(f"{self.what}: cannot register None as a local variable")
        inner = getattr(var, "_value", None)
        for key, obj in zip(_identities(var), (var, inner)):
            self._held[key] = obj

    def __len__(self) -> int:
        return len({id(o) for o in self._held.values()})

    def is_local(self, var: Any) -> bool:
        """Whether ``var`` (or the variable it wraps) was registered."""
        return any(key in self._held for key in _identities(var))

    def positions(self, variables: Sequence[Any]) -> list:
        """Indices of the local ones among ``variables``."""
        if not self._held:
            return []
        return [i for i, v in enumerate(variables) if v is not None and self.is_local(v)]

    def combine(self, grads: Sequence[Any], variables: Optional[Sequence[Any]],
                reduce: Callable[[list, Optional[tuple]], list],
                scale: Callable[[Any], Any]) -> list:
        """``grads`` (one per variable, in order) with the shared ones reduced and the local
        ones kept (divided by ``size()`` through ``scale`` when scaling).

        ``reduce(shared_grads, marker_shape)`` reduces the shared gradients as one group and
        adds the zero-element marker of ``marker_shape`` to it (``None``: no local gradient
        in this call, so the group is exactly the unpartitioned one).
        """
        grads = list(grads)
        local = self.positions(variables) if variables is not None else []
        if variables is not None and len(variables) != len(grads):
            raise InvalidInputError(f"{self.what}: {len(grads)} gradients for "
                                    f"{len(variables)} variables")
        if not local:
            return reduce(grads, None)
        skip = set(local)
        shared = [i for i in range(len(grads)) if i not in skip]
        out = list(grads)
        for i, r in zip(shared, reduce([grads[i] for i in shared],
                                       layout_shape(len(grads), local))):
            out[i] = r
        if self.scale:
            for i in local:
                if out[i] is not None:
                    out[i] = scale(out[i])
        return out


def local_layer_variables(what: str, local_layers: Any, layer_type: type) -> list:
    """The trainable variables of Horovod's ``local_layers`` argument: ``None``, one layer, or a
    list or tuple of layers (anything else: ``InvalidInputError`` naming it)."""
    if local_layers is None:
        return []
    if isinstance(local_layers, layer_type):
        layers = [local_layers]
    elif isinstance(local_layers, (list, tuple)):
        layers = list(local_layers)
        bad = [x for x in layers if not isinstance(x, layer_type)]
        if bad:
            raise InvalidInputError(
                f"{what}: local_layers must be a {layer_type.__name__} or a list of them; the "
                f"list holds {', '.join(_describe(x) for x in bad[:3])}")
    else:
        raise InvalidInputError(f"{what}: local_layers must be a {layer_type.__name__} or a "
                                f"list of them, got {_describe(local_layers)}")
    return [v for layer in layers for v in layer.trainable_weights]


def _describe(obj: Any) -> str:
    text = repr(obj)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(obj).__name__} {text}"
