"""Elastic training with PyTorch (Horovod's ``horovod.torch.elastic``)::

    import ringreduce.torch as hvd

    hvd.init()
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for i, (x, y) in enumerate(loader):  # this epoch's samples not processed yet
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
                state.sampler.record_batch(i, 32)
                state.commit()
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

The retry loop and its protocol are ``ringreduce.elastic``'s (``run_fn``, see
``ringreduce/elastic/state.py``); this module adds the torch objects to the state.

DistributedOptimizer across generations: in an elastic job its constructor does no
collective (a worker that joins later constructs one while the others do not). The
optimizers a ``TorchState`` holds are set up for each generation's communicator by
``sync()`` (every rank, at the start of the generation): the ranks agree on the
parameters and the gradient buckets are laid out afresh in the new job's shared memory.
After a reset that skips ``sync()`` (hosts were only removed) the first ``commit()`` does
it. Until then gradients are averaged without buckets. Every reset makes every
DistributedOptimizer of the process drop what belonged to the closed generation (in-flight
allreduces, partial accumulations, bucket views; ``ringreduce.elastic.after_reset``):
every ``p.grad`` is None again.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

import ringreduce.elastic as _elastic
from ringreduce.elastic import HostsUpdatedInterrupt, ObjectState, State
from ringreduce.elastic.sampling import ElasticIndices, merge_processed

from .broadcast import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]


run = _elastic.run  # Horovod's hvd.elastic.run: the retry loop is ringreduce.elastic's


class ElasticSampler(ElasticIndices, torch.utils.data.Sampler):
    """A sampler that shards a dataset over the ranks and, after a reset, deals the samples
    not processed yet this epoch over the new ranks (Horovod's ``ElasticSampler``).

    Call ``record_batch(batch_idx, batch_size)`` after each step (``batch_idx`` counted
    from 0 since the loader was last iterated afresh) and ``set_epoch(epoch)`` at each new
    epoch; keep it in the ``TorchState``, which commits, restores and syncs it. See
    ``ringreduce.elastic.sampling`` for the protocol.

    Parameters
    ----------
    dataset : torch.utils.data.Dataset
        A dataset with ``len()``.
    shuffle : bool
        Shuffle each epoch (the same order on every rank: seed ``seed + epoch``).
    seed : int
        Base of the shuffle's seed.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        ElasticIndices.__init__(self, len(dataset), shuffle, seed)

    def reset(self) -> None:
        """Deal the remaining samples over the current ``size()`` / ``rank()``."""
        self.length = len(self.dataset)
        super().reset()


class _Handler:
    """Saves, restores and syncs one torch object of a TorchState."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved: Any = None
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        raise NotImplementedError

    def setup(self) -> None:
        """Collective per-generation setup (optimizers only)."""

    def after_reset(self) -> None:
        """Forget the closed generation (local: no collective)."""


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def setup(self) -> None:
        if hasattr(self.value, "elastic_setup"):  # a DistributedOptimizer (not Adasum)
            self.value.elastic_setup()

    def after_reset(self) -> None:
        if hasattr(self.value, "elastic_drop"):
            self.value.elastic_drop()

    def sync(self) -> None:
        self.setup()
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def after_reset(self) -> None:
        self.value.reset()  # the new size() / rank(), also where no sync() follows

    def sync(self) -> None:
        merge_processed(self.value, lambda obj: allgather_object(obj, name="elastic.sampler"),
                        lambda obj: broadcast_object(obj, 0, name="elastic.sampler.state"))


def _handler(value: Any) -> Optional[_Handler]:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training job kept across resets (Horovod's ``TorchState``).

    ``commit()`` saves in memory deep copies of the model's and the optimizer's
    ``state_dict()``, of every ElasticSampler's position and of the other keyword values;
    ``restore()`` loads them back; ``sync()`` sends rank 0's to every rank (parameters and
    buffers, optimizer state, samplers with the processed samples of all ranks, values).
    Any keyword whose value is a ``torch.nn.Module``, ``torch.optim.Optimizer`` or
    ``ElasticSampler`` is handled like ``model`` / ``optimizer``; the others are plain
    picklable values. All are attributes: ``state.model``, ``state.epoch``...

    Parameters
    ----------
    model : torch.nn.Module, optional
    optimizer : torch.optim.Optimizer, optional
        Usually a DistributedOptimizer: ``sync()`` also sets it up for the generation.
    **kwargs :
        More torch objects, and values such as ``epoch=0, batch=0``.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any) -> None:
        values = {"model": model, "optimizer": optimizer, **kwargs}
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in values.items():
            handler = _handler(value)
            if handler is not None:
                handlers[name] = handler
            elif name not in ("model", "optimizer"):
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:  # state.model = other_model: commit that one from now on
            handlers[name].value = value
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Rank 0's state to every rank, which also becomes every rank's committed state
        (a worker that just joined would otherwise restore its own initial state if the
        generation failed before its first commit)."""
        for handler in self._handlers.values():
            handler.sync()
            handler.save()
        super().sync()

    def commit(self) -> None:
        """Set up the optimizers if no ``sync()`` did in this generation, then save and
        check for host updates (collective: the same step on every rank)."""
        for handler in self._handlers.values():
            handler.setup()
        super().commit()

    def on_reset(self) -> None:
        """Drop the closed generation's optimizer state, deal the samplers' remaining
        samples over the new ranks, then run the reset callbacks."""
        for handler in self._handlers.values():
            handler.after_reset()
        super().on_reset()
