"""DistributedOptimizer for Keras 3: ``apply()`` uses gradients averaged over all ranks.

Keras 3 calls ``optimizer.apply(grads, variables)`` (through ``apply_gradients``) from
``model.fit``'s train step; the wrapper puts one method in front of the optimizer's
class, so any Keras optimizer (Adam, SGD, LossScaleOptimizer, a custom subclass) keeps
its state, hyper-parameters and serialization. The wrapped optimizer *is* the one
passed in (its class is swapped for a subclass with the same name and module), so a
model saved with it loads as the plain optimizer class, and ``load_model`` wraps it.

Backends: TensorFlow (one fused graph op per step, see ringreduce.tensorflow), torch
(eager ``ringreduce.torch.grouped_allreduce``) and JAX (the trainer updates through
``stateless_apply`` inside ``jax.jit``; ``ringreduce.jax.grouped_allreduce`` joins it as
an ordered host callback).

Loss scaling: a ``LossScaleOptimizer`` skips a step when its gradients are not finite, so
that check must see the averaged gradients, the same on every rank (a rank that skipped
alone would leave its peers waiting in the averaging). Wrapping a LossScaleOptimizer
(Horovod's recipe) averages before its check on every backend. ``compile()`` under the
``mixed_float16`` policy wraps the optimizer it is given in a new LossScaleOptimizer, the
other way round; ringreduce.keras then moves the averaging out to that LossScaleOptimizer
(a hook on ``LossScaleOptimizer.__init__``, acting only when the inner optimizer is a
DistributedOptimizer, which then applies as its plain class while the outer one calls it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import keras

from ringreduce import Average
from ringreduce._horovod import check_passes, optimizer_scales
from ringreduce._local_grads import LocalVariables, local_layer_variables
from ringreduce.compression import Compressor, NoneCompressor
from ringreduce.exceptions import InvalidInputError
from ringreduce.process_sets import global_process_set

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]

_CLASSES: dict = {}
# True while a distributed LossScaleOptimizer applies through its inner optimizer: an inner
# DistributedOptimizer then applies as its plain class would (the outer one averaged).
_INNER = contextvars.ContextVar("ringreduce_keras_inner", default=False)


class _LayerReducer:
    """A backend's averaging through a ringreduce framework layer (``layer``: its module):
    one grouped allreduce of the dense gradients; None gradients stay None."""

    def __init__(self, layer: Any, compression: type[Compressor], op: int,
                 scales: tuple, process_set: Any = None) -> None:
        self.process_set = process_set or global_process_set
        wire = getattr(compression, "wire", None)  # a torch, TensorFlow or JAX dtype
        name = (getattr(wire, "name", None) or getattr(wire, "__name__", None)
                or str(wire).rsplit(".", 1)[-1])
        self.compression = {"float16": layer.Compression.fp16,
                            "bfloat16": layer.Compression.bf16}.get(name, layer.Compression.none)
        if compression is not NoneCompressor and self.compression is layer.Compression.none:
            raise InvalidInputError(f"DistributedOptimizer: with the {keras.backend.backend()} "
                                    "backend only Compression.none, .fp16 and .bf16 are "
                                    "available")
        self.op, self.scales, self.layer = op, scales, layer

    def included(self) -> bool:
        """Whether this rank averages (a member of the process set); else it keeps its own
        gradients, as Horovod's optimizers do."""
        return self.process_set.process_set_id == 0 or self.process_set.included()

    def __call__(self, grads: list, marker: Any = None) -> list:
        if not self.included():
            return grads
        dense = [i for i, g in enumerate(grads) if g is not None]
        members = [grads[i] for i in dense]
        if marker is not None:  # ringreduce._local_grads: the local positions' digest
            members.append(self._zeros(marker, members[0] if members else None))
        if not members:
            return grads
        out = list(grads)
        for i, r in zip(dense, self._reduce(members)):
            out[i] = r
        return out

    def _zeros(self, shape: tuple, like: Any) -> Any:
        import jax.numpy as jnp

        return jnp.zeros(shape, jnp.float32 if like is None else like.dtype)

    def scale_local(self, grad: Any) -> Any:
        """A local gradient divided by ``size()`` (Horovod's ``scale_local_gradients``)."""
        return grad / self.process_set.size()

    def _reduce(self, grads: list) -> list:
        return self.layer.grouped_allreduce(
            grads, compression=self.compression, op=self.op, prescale_factor=self.scales[0],
            postscale_factor=self.scales[1], name="DistributedOptimizer",
            process_set=self.process_set)


class _TorchReducer(_LayerReducer):
    """The torch backend's averaging: eager, on the communicator current at wrapping."""

    def __init__(self, compression: type[Compressor], op: int, scales: tuple,
                 process_set: Any = None) -> None:
        import ringreduce.torch as rrt

        super().__init__(rrt, compression, op, scales, process_set)
        self.get = rrt._tensors.binder()

    def __call__(self, grads: list, marker: Any = None) -> list:
        return grads if self.get().size() == 1 else super().__call__(grads, marker)

    def _zeros(self, shape: tuple, like: Any) -> Any:
        import torch

        return torch.zeros(shape) if like is None else like.new_zeros(shape)

    def scale_local(self, grad: Any) -> Any:
        """A local gradient divided by ``size()`` (Horovod's ``scale_local_gradients``)."""
        with self.layer.use_communicator(self.get()):
            return super().scale_local(grad)

    def _reduce(self, grads: list) -> list:
        with self.layer.use_communicator(self.get()):
            return super()._reduce([g.detach() for g in grads])


class _JaxReducer(_LayerReducer):
    """The JAX backend's averaging, traced into the trainer's jitted step as an ordered
    host callback (``ringreduce.jax``)."""

    def __init__(self, compression: type[Compressor], op: int, scales: tuple,
                 process_set: Any = None) -> None:
        import ringreduce.jax as rrj

        super().__init__(rrj, compression, op, scales, process_set)

    def on_update_steps(self, grads: list, is_update_step: Any, factor: float,
                        reduce: Any) -> list:
        """With Keras's gradient accumulation: ``grads`` (the local mean of the steps)
        times ``factor``, averaged over the ranks on the steps that update, and left as
        they are on the others. Keras's JAX optimizer runs its update on every step and
        keeps the result only on update steps; the averaging sits in the branch of a
        ``lax.cond``, so the ranks talk once per update. ``reduce``: the optimizer's
        averaging (``self`` around its local variables)."""
        import jax

        def update() -> list:
            return reduce([g * factor for g in grads] if factor != 1 else list(grads))

        return jax.lax.cond(is_update_step, update, lambda: list(grads))


class _DistributedKerasMixin:
    """Put in front of the optimizer's class (see the module docstring)."""

    def _rr_setup(self, reduce: Any, passes: int, average_aggregated: bool,
                  local_vars: LocalVariables) -> None:
        object.__setattr__(self, "_rr_reduce", reduce)
        object.__setattr__(self, "_rr_local_vars", local_vars)
        object.__setattr__(self, "_rr_passes", passes)
        object.__setattr__(self, "_rr_average_aggregated", average_aggregated)
        object.__setattr__(self, "_rr_aggregation", None)
        object.__setattr__(self, "_rr_local", [])  # the torch backend's local sums
        object.__setattr__(self, "_rr_count", 0)  # and the passes they hold

    def register_local_var(self, var: Any) -> None:
        """Horovod's: keep this rank's own gradient of ``var`` (a variable of a model-parallel
        layer), not reduced across ranks; divided by ``size()`` with
        ``scale_local_gradients=True``. Every rank must register the same positions among
        the trainable variables (else ``MismatchError``; see ``ringreduce._local_grads``)."""
        self._rr_local_vars.register(var)

    def _rr_average(self, grads: list, variables: Any) -> list:
        """``grads`` averaged over the ranks, except those of local variables (kept, scaled)."""
        local = self._rr_local_vars
        if not len(local) or not self._rr_reduce.included():
            return self._rr_reduce(grads)
        if variables is None:
            variables = self._trainable_variables
        reduce = self._rr_reduce
        if isinstance(reduce, (_TorchReducer, _JaxReducer)):
            scale = reduce.scale_local
        else:
            from ringreduce.tensorflow.gradients import scale_by_size

            scale = scale_by_size(reduce.get)
        return local.combine(grads, list(variables), reduce, scale)

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Average ``grads`` over all ranks, then apply them as the wrapped optimizer does.

        With ``backward_passes_per_step=k > 1`` the gradients of k calls are summed
        locally (divided by k with ``average_aggregated_gradients=True``) and averaged
        and applied on every k-th call only; ``iterations`` counts applications.
        """
        grads = list(grads)
        if _INNER.get() or self._rr_reduces_on_update_steps():
            return super().apply(grads, trainable_variables)  # see _INNER, _clip_gradients
        if self._rr_passes == 1:
            with self._rr_through():
                return super().apply(self._rr_average(grads, trainable_variables),
                                     trainable_variables)
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))  # before any branch: variables are made once
        if keras.backend.backend() == "tensorflow":
            return self._rr_aggregate_graph(grads, trainable_variables)
        return self._rr_aggregate_eager(grads, trainable_variables)

    def _rr_reduces_on_update_steps(self) -> bool:
        return isinstance(self._rr_reduce, _JaxReducer) and bool(self.gradient_accumulation_steps)

    @contextlib.contextmanager
    def _rr_through(self) -> Iterator[None]:
        """Around this optimizer's own update with averaged gradients: if it is a
        LossScaleOptimizer, its inner optimizer (a DistributedOptimizer too, when
        compile() wrapped one) must not average them again."""
        token = _INNER.set(True) if isinstance(self, keras.optimizers.LossScaleOptimizer) \
            else None
        try:
            yield
        finally:
            if token is not None:
                _INNER.reset(token)

    def stateless_apply(self, optimizer_variables: Any, grads: Any,
                        trainable_variables: Any) -> Any:
        """The JAX trainer's update. The base class's calls ``apply`` (which averages);
        a LossScaleOptimizer's checks and applies without it, so it averages here first."""
        if _INNER.get() or not isinstance(self, keras.optimizers.LossScaleOptimizer) or \
                self._rr_reduces_on_update_steps():
            return super().stateless_apply(optimizer_variables, grads, trainable_variables)
        grads = self._rr_average(list(grads), None)
        with self._rr_through():
            return super().stateless_apply(optimizer_variables, grads, trainable_variables)

    def _clip_gradients(self, grads: Any) -> Any:
        """On the JAX backend with gradient accumulation (Keras's own
        ``gradient_accumulation_steps``, which ``backward_passes_per_step`` sets): the
        accumulated gradients are averaged over the ranks here, before clipping, as
        ``apply`` averages them otherwise."""
        if self._rr_reduces_on_update_steps() and not _INNER.get():
            steps = self.gradient_accumulation_steps
            factor = steps if self._rr_passes > 1 and not self._rr_average_aggregated else 1
            grads = self._rr_reduce.on_update_steps(
                list(grads), (self._iterations + 1) % steps == 0, factor,
                lambda gs: self._rr_average(gs, None))
        return super()._clip_gradients(grads)

    def _rr_aggregate_graph(self, grads: list, trainable_variables: Any) -> Any:
        from ringreduce.tensorflow.gradients import LocalAggregation

        if self._rr_aggregation is None:
            object.__setattr__(self, "_rr_aggregation", LocalAggregation(
                self._rr_passes, self._rr_average_aggregated, "DistributedOptimizer"))

        def update(local: list) -> None:
            with self._rr_through():
                super(_DistributedKerasMixin, self).apply(
                    self._rr_average(local, trainable_variables), trainable_variables)

        return self._rr_aggregation.step(grads, update, trainable_variables)

    def _rr_aggregate_eager(self, grads: list, trainable_variables: Any) -> Any:
        local = self._rr_local
        if not local:
            local.extend(None if g is None else g.detach().clone() for g in grads)
        else:
            for i, g in enumerate(grads):
                if g is not None:
                    local[i] = g.detach().clone() if local[i] is None else local[i] + g
        count = self._rr_count + 1
        if count < self._rr_passes:
            object.__setattr__(self, "_rr_count", count)
            return None
        object.__setattr__(self, "_rr_count", 0)
        summed = [None if s is None else (s / self._rr_passes if self._rr_average_aggregated
                                          else s) for s in local]
        local.clear()
        with self._rr_through():
            return super().apply(self._rr_average(summed, trainable_variables),
                                 trainable_variables)


def _reducer(what: str, compression: type[Compressor], sparse_as_dense: bool, op: int,
             gradient_predivide_factor: float, num_groups: Any, groups: Any,
             process_set: Any) -> Any:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from ringreduce.tensorflow.gradients import GradientAverager

        return GradientAverager(what, compression, sparse_as_dense, op,
                                gradient_predivide_factor, num_groups, groups,
                                process_set=process_set)
    if backend in ("torch", "jax"):
        scales = optimizer_scales(what, op, gradient_predivide_factor, num_groups, groups,
                                  "ringreduce.keras")
        return (_TorchReducer if backend == "torch" else _JaxReducer)(compression, op, scales,
                                                                      process_set)
    raise InvalidInputError(
        f"{what}: Keras's {backend!r} backend is not supported; use the tensorflow, torch "
        "or jax backend (KERAS_BACKEND=tensorflow)")


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Any = None,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = NoneCompressor,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = None,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """Make a Keras 3 optimizer apply gradients averaged over all ranks (Horovod's signature).

    Parameters
    ----------
    optimizer : keras.optimizers.Optimizer
        Any Keras optimizer; it is returned, wrapped in place (its class gains the
        averaging ``apply``; state, hyper-parameters and config are kept).
    name, device_dense, device_sparse :
        Horovod's; ignored.
    compression : Compressor
        ``Compression.none`` (default), ``.fp16`` or ``.bf16``.
    sparse_as_dense : bool
        Reduce IndexedSlices gradients (embeddings) as dense tensors instead of
        allgathering them.
    gradient_predivide_factor : float
        With Average: divide by it before the sum and by ``size / factor`` after.
    op : int
        ``Average`` (default) or ``Sum``.
    backward_passes_per_step : int
        Sum this many steps' gradients locally before averaging and applying them.
    average_aggregated_gradients : bool
        Divide that local sum by ``backward_passes_per_step``.
    num_groups, groups :
        Horovod's fusion hints; accepted and ignored (one fused group per step).
    process_set : ProcessSet, optional
        Average over its members only; a rank outside it applies its own gradients (as
        Horovod). Local gradients are then divided by the set's size.
    scale_local_gradients : bool
        Divide the gradients of variables registered with ``register_local_var`` (which are
        not reduced) by ``size()``, as Horovod does.

    Returns
    -------
    keras.optimizers.Optimizer
        ``optimizer`` itself.
    """
    return _distributed("DistributedOptimizer", optimizer, compression, sparse_as_dense,
                        gradient_predivide_factor, op, backward_passes_per_step,
                        average_aggregated_gradients, num_groups, groups, process_set,
                        scale_local_gradients)


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802
                                name: Any = None, device_dense: str = "",
                                device_sparse: str = "",
                                compression: type[Compressor] = NoneCompressor,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = Average,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                num_groups: int = 0, groups: Any = None,
                                process_set: Any = None, local_layers: Any = None,
                                scale_local_gradients: bool = True
                                ) -> keras.optimizers.Optimizer:
    """Horovod's model-parallel optimizer: ``DistributedOptimizer`` whose gradients of the
    ``local_layers``' trainable variables stay this rank's own (not reduced; divided by
    ``size()`` with ``scale_local_gradients=True``).

    Parameters
    ----------
    optimizer : keras.optimizers.Optimizer
        Wrapped in place, as by ``DistributedOptimizer``.
    local_layers : keras.layers.Layer or list of them, optional
        Layers whose trainable variables are registered with ``register_local_var``.
        ``None``: the optimizer is a ``DistributedOptimizer``.
    scale_local_gradients : bool
        Divide the local gradients by ``size()`` (Horovod's default).
    name, device_dense, device_sparse, compression, sparse_as_dense, \
gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients, \
num_groups, groups, process_set :
        As for ``DistributedOptimizer``.

    Returns
    -------
    keras.optimizers.Optimizer
        ``optimizer`` itself.
    """
    what = "PartialDistributedOptimizer"
    local_vars = local_layer_variables(what, local_layers, keras.layers.Layer)
    optimizer = _distributed(what, optimizer, compression, sparse_as_dense,
                             gradient_predivide_factor, op, backward_passes_per_step,
                             average_aggregated_gradients, num_groups, groups, process_set,
                             scale_local_gradients)
    for var in local_vars:
        optimizer.register_local_var(var)
    return optimizer


def _distributed(what: str, optimizer: Any, compression: type[Compressor],
                 sparse_as_dense: bool, gradient_predivide_factor: float, op: int,
                 backward_passes_per_step: int, average_aggregated_gradients: bool,
                 num_groups: Any, groups: Any, process_set: Any,
                 scale_local_gradients: bool) -> keras.optimizers.Optimizer:
    local_vars = LocalVariables(what, scale_local_gradients)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidInputError(f"{what}: expected a keras.optimizers.Optimizer, got "
                                f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedKerasMixin):
        raise InvalidInputError(f"{what}: this optimizer is already a DistributedOptimizer")
    passes = check_passes(what, backward_passes_per_step)
    # the group's name is DistributedOptimizer's for both wrappers (one name per instance)
    reduce = _reducer("DistributedOptimizer", compression, sparse_as_dense, op,
                      gradient_predivide_factor, num_groups, groups, process_set)
    if passes > 1 and isinstance(reduce, _JaxReducer):
        _accumulate_in_keras(what, optimizer, passes)
    _wrap(optimizer, reduce, passes, average_aggregated_gradients, local_vars)
    return optimizer


def _wrap(optimizer: keras.optimizers.Optimizer, reduce: Any, passes: int,
          average_aggregated: bool, local_vars: LocalVariables) -> None:
    """Swap ``optimizer``'s class for its distributed subclass and set it up."""
    base = type(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(base.__name__, (_DistributedKerasMixin, base),
                                    {"__module__": base.__module__,
                                     "__qualname__": base.__qualname__})
    optimizer.__class__ = cls
    optimizer._rr_setup(reduce, passes, average_aggregated, local_vars)


def _move_into_loss_scaling(inner: Any, outer: keras.optimizers.LossScaleOptimizer) -> None:
    """The averaging of DistributedOptimizer ``inner`` moves out to ``outer``, the
    LossScaleOptimizer that ``compile()`` (mixed_float16) just wrapped around it, so that
    its finite check sees averaged gradients. ``inner`` stays a DistributedOptimizer
    (compiled again, or used alone, it averages): called by ``outer``, it applies as its
    plain class (``_INNER``)."""
    passes = inner._rr_passes
    if passes > 1 and isinstance(inner._rr_reduce, _JaxReducer):
        raise _no_loss_scaled_accumulation("DistributedOptimizer", passes)
    _wrap(outer, inner._rr_reduce, passes, inner._rr_average_aggregated, inner._rr_local_vars)


def _hook_loss_scaling() -> None:
    """Make ``LossScaleOptimizer(distributed)`` move the averaging out (see the module
    docstring); once per process."""
    cls = keras.optimizers.LossScaleOptimizer
    original = cls.__init__
    if getattr(original, "_rr_hook", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, inner_optimizer: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original(self, inner_optimizer, *args, **kwargs)
        if isinstance(inner_optimizer, _DistributedKerasMixin) and \
                not isinstance(self, _DistributedKerasMixin):
            _move_into_loss_scaling(inner_optimizer, self)

    __init__._rr_hook = True
    cls.__init__ = __init__


_hook_loss_scaling()


def _accumulate_in_keras(what: str, optimizer: keras.optimizers.Optimizer, passes: int) -> None:
    """backward_passes_per_step on the JAX backend: Keras's own gradient accumulation
    (its step is one compiled function, so the local sum lives in the optimizer's
    variables), with the averaging on update steps only (_clip_gradients)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise _no_loss_scaled_accumulation(what, passes)
    if optimizer.gradient_accumulation_steps:
        raise InvalidInputError(
            f"{what}: the optimizer already has gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}; give backward_passes_per_step or "
            "gradient_accumulation_steps, not both")
    if optimizer.built:
        raise InvalidInputError(
            f"{what}: backward_passes_per_step={passes} with the jax backend needs an "
            "optimizer that has not been built yet (its accumulators are made in build()); "
            "wrap it before compile() or the first step")
    optimizer.gradient_accumulation_steps = passes


def _no_loss_scaled_accumulation(what: str, passes: int) -> InvalidInputError:
    return InvalidInputError(
        f"{what}: backward_passes_per_step={passes} with a LossScaleOptimizer (or "
        "mixed_float16) on the jax backend is not supported: Keras's LossScaleOptimizer "
        "does not accumulate gradients there; use backward_passes_per_step=1, or the "
        "tensorflow or torch backend")


def is_distributed(optimizer: Any) -> bool:
    """Whether ``optimizer`` was wrapped by ``DistributedOptimizer``."""
    return isinstance(optimizer, _DistributedKerasMixin)
