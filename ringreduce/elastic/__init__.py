"""Elastic training (Horovod's ``hvd.elastic``): keep training while workers fail, hosts
are added or removed.

Start the job with ``ringrun --min-np/--max-np`` (and a ``--host-discovery-script`` to grow
it); wrap the training function in ``run`` and keep what must survive a reset in a
``State`` (``ObjectState`` for plain values; ``ringreduce.torch.elastic.TorchState``,
``ringreduce.tensorflow.elastic.TensorFlowKerasState``, ``ringreduce.keras.elastic``...
for models)::

    state = ringreduce.elastic.ObjectState(epoch=0)

    @ringreduce.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 10):
            ...
            state.commit()

    train(state)
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from ..exceptions import HostsUpdatedInterrupt
from ._client import in_elastic_job
from .state import ObjectState, State, recoverable, run_fn

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "after_reset", "in_elastic_job",
           "recoverable", "reset", "run", "run_fn"]

_AFTER_RESET: list[weakref.WeakMethod] = []


def after_reset(method: Callable[[], Any]) -> None:
    """Call the bound ``method`` after every ``reset()`` (once the new generation is
    joined, before the state's reset callbacks), for as long as its object lives.

    For framework layers: e.g. a DistributedOptimizer forgets the closed generation's
    in-flight allreduces and gradient buffers, whether or not a State holds it.

    Parameters
    ----------
    method : bound method
        Takes no arguments; held weakly.
    """
    _AFTER_RESET.append(weakref.WeakMethod(method))


def reset() -> None:
    """Leave the current generation and join the next one (``shutdown()`` + ``init()``;
    ``init()`` itself joins again when a generation breaks up while it forms, and the
    driver ends the job with a RingReduceError when it cannot go on). Then the
    ``after_reset`` methods run.
    """
    import ringreduce as rr

    rr.shutdown()
    rr._reinit()
    for ref in list(_AFTER_RESET):
        method = ref()
        if method is None:
            _AFTER_RESET.remove(ref)
        else:
            method()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``func(state, ...)`` again from the last commit when a worker fails,
    and from the current step when hosts are added or removed (Horovod's
    ``hvd.elastic.run``). Outside an elastic job it runs ``func`` once after
    ``state.sync()``.

    Parameters
    ----------
    func : callable
        The training function; its first argument is the ``State``.

    Returns
    -------
    callable
        The wrapped function.
    """
    return run_fn(func, reset)
