"""Which samples each rank reads in an elastic job: the bookkeeping behind the framework
layers' elastic samplers (``ringreduce.torch.elastic.ElasticSampler``).

Protocol (Horovod's ``ElasticSampler``): an epoch's order is a deterministic shuffle of
``range(n)`` (seed ``seed + epoch``, the same on every rank). The indices not yet processed
this epoch are padded (repeating from their start) to a multiple of ``size()`` and dealt
out round-robin: rank ``r`` reads positions ``r, r + size, ...``. The training loop records
what it processed (``record_batch`` after each step); ``state_dict()`` is what a ``State``
commits. After a reset ``reset()`` deals the *remaining* indices over the new
``size()``/``rank()``, so the epoch goes on where the last commit left it, with no sample
read twice or skipped (apart from the padding).

Unlike Horovod, ``record_batch`` records the batch of *every* rank (the ranks step in
lockstep, so when one has finished batch ``i`` all have): a worker that dies does not take
the record of its samples with it, and the survivors do not read them again.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

__all__ = ["ElasticIndices", "merge_processed"]


def _world() -> tuple[int, int]:
    import ringreduce as rr

    return rr.size(), rr.rank()


class ElasticIndices:
    """The sample indices of one rank for the rest of an epoch (see the module docstring).

    Parameters
    ----------
    length : int
        Number of samples (``len(dataset)``).
    shuffle : bool
        Shuffle each epoch's order (seed ``seed + epoch``, the same on every rank).
    seed : int
        Base of the shuffle's seed.
    world : callable, optional
        ``() -> (size, rank)``; default ``ringreduce.size()``, ``ringreduce.rank()``.
    """

    def __init__(self, length: int, shuffle: bool = True, seed: int = 0,
                 world: Optional[Callable[[], tuple[int, int]]] = None) -> None:
        self.length, self.shuffle, self.seed = int(length), bool(shuffle), int(seed)
        self._world = world or _world
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []  # this rank's share of the remaining, in order
        self.num_samples = self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: nothing processed yet, a new order."""
        self.epoch = int(epoch)
        self.processed_indices = set()
        self.reset()

    def order(self) -> list[int]:
        """The epoch's order of all indices (the same on every rank)."""
        order = list(range(self.length))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def reset(self) -> None:
        """Deal the indices not processed yet over the current ``size()`` / ``rank()``."""
        self.num_replicas, self.rank = self._world()
        self.remaining_indices = [i for i in self.order() if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._share(self.rank)

    def _share(self, rank: int) -> list[int]:
        rem = self.remaining_indices  # padded by repeating from the start
        return [rem[k % len(rem)] for k in range(rank, self.total_size, self.num_replicas)]

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's indices of batch ``batch_idx`` (since the last ``reset``)."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record batch ``batch_idx`` (counted since the last reset) of every rank as
        processed: call it after the step that used it."""
        rem, replicas = self.remaining_indices, self.num_replicas
        # Rank r reads padded position r + j * replicas as its j-th sample, so batch
        # ``batch_idx`` of all ranks is one run of positions.
        lo = batch_idx * batch_size * replicas
        hi = min((batch_idx + 1) * batch_size * replicas, self.total_size)
        self.processed_indices.update(rem[k % len(rem)] for k in range(lo, hi))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record these indices as processed (this rank's; ``TorchState.sync`` unites the
        ranks' records)."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples


def merge_processed(indices: ElasticIndices, allgather_object: Callable[[Any], list],
                    broadcast_object: Callable[[Any], Any]) -> None:
    """Make every rank's sampler rank 0's, with the processed indices of all ranks
    (collective; the ``sync`` of a ``State`` that holds a sampler).

    Parameters
    ----------
    indices : ElasticIndices
        This rank's sampler.
    allgather_object, broadcast_object : callable
        ``obj -> list of every rank's obj`` and ``obj -> rank 0's obj``.
    """
    union: set[int] = set()
    for processed in allgather_object(set(indices.processed_indices)):
        union |= processed
    state = indices.state_dict()
    state["processed_indices"] = union
    indices.load_state_dict(broadcast_object(state))
