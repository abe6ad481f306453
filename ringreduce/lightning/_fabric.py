"""ringreduce's strategy for Lightning Fabric (``Fabric(strategy="ringreduce")``).

Fabric leaves the loop to the user, so the strategy only answers Fabric's calls::

    fabric.setup(model, optimizer)   parameters broadcast from rank 0; each optimizer a
                                     DistributedOptimizer over the model's named
                                     parameters (state broadcast), held in
                                     skip_synchronize() until teardown
    fabric.backward(loss)            the gradients' hooks start the allreduces
    with fabric.no_backward_sync(model, enabled=True):
        fabric.backward(loss)        the optimizers' no_sync(): accumulate locally
    fabric.clip_gradients(...)       waits for the averages first (synchronize())
    optimizer.step()                 waits for the averages unless clipping did, steps

Invariant: an optimizer is synchronized once after the backward passes that precede its
step and before anything reads their gradients (clipping, unscaling, the step); a clip
repeated after more backward passes synchronizes again (``synchronize_pending``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Optional

import torch

import ringreduce as rr
import ringreduce.torch as rrt
from ringreduce.exceptions import InvalidInputError

from ._strategy import (
    Collectives,
    _environment_class,
    _named,
    _sync_metrics,
    _unwrap,
    started,
    synchronize_pending,
)


class FabricMethods(Collectives):
    """What RingreduceFabricStrategy adds to Fabric's ParallelStrategy (in front of it)."""

    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list,
                                    scheduler: Any = None) -> tuple:
        module = self.setup_module(module)
        return module, [self._setup_named(o, module) for o in optimizers], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        rrt.broadcast_parameters(module.state_dict(), root_rank=0)
        _sync_metrics(module)
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self._setup_named(optimizer, None)

    def _setup_named(self, optimizer: Any, module: Optional[torch.nn.Module]) -> Any:
        named = _named(module, optimizer) if module is not None else None
        wrapped = self._wrap(_unwrap(optimizer), named)
        self._wrapped.append(wrapped)
        return wrapped

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        synchronize_pending(optimizer)
        return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: Any, *args: Any,
                            **kwargs: Any) -> torch.Tensor:
        synchronize_pending(optimizer)
        return super().clip_gradients_norm(module, optimizer, *args, **kwargs)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: Any,
                             clip_val: Any) -> None:
        synchronize_pending(optimizer)
        return super().clip_gradients_value(module, optimizer, clip_val)

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self.reduce(tensor, group, reduce_op)

    def teardown(self) -> None:
        self._release()
        self._wrapped.clear()
        super().teardown()


class _BackwardSync:
    """Fabric's ``no_backward_sync``: backward passes inside only accumulate locally (the
    no_sync() of every optimizer the strategy wrapped)."""

    def __init__(self, wrapped: list) -> None:
        self.wrapped = wrapped

    @contextmanager
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        with ExitStack() as stack:
            for opt in self.wrapped:
                if not hasattr(opt, "no_sync"):
                    raise InvalidInputError(
                        f"rank {rr.rank()}: RingreduceFabricStrategy.no_backward_sync: an "
                        "optimizer with op=Adasum steps on every pass; use op=Average")
                stack.enter_context(opt.no_sync())
            yield


def build_fabric(package: str) -> type:
    """RingreduceFabricStrategy for a Fabric package ("lightning.fabric" or
    "lightning_fabric"), registered in its registry as "ringreduce"."""
    strategies = importlib.import_module(package + ".strategies")
    env_cls = _environment_class(package)

    class RingreduceFabricStrategy(FabricMethods, strategies.ParallelStrategy):
        """Lightning Fabric over ringreduce: one process per device, started by mpirun,
        ``ringrun``, Spark or Ray (see the module docstring for what each call does)."""

        strategy_name = "ringreduce"

        def __init__(self, accelerator: Any = None, parallel_devices: Optional[list] = None,
                     checkpoint_io: Any = None, precision: Any = None, *,
                     compression: Any = rrt.Compression.none,
                     gradient_predivide_factor: float = 1.0, op: int = rr.Average,
                     sparse_as_dense: bool = False) -> None:
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=started(env_cls),
                             checkpoint_io=checkpoint_io, precision=precision)
            self._options(compression=compression, op=op, sparse_as_dense=sparse_as_dense,
                          gradient_predivide_factor=gradient_predivide_factor)
            self._wrapped: list = []
            self._backward_sync_control = _BackwardSync(self._wrapped)

    strategies.STRATEGY_REGISTRY.register("ringreduce", RingreduceFabricStrategy,
                                          description=RingreduceFabricStrategy.__doc__,
                                          override=True)
    return RingreduceFabricStrategy
